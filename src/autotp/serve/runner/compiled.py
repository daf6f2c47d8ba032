"""The paged engine's decode step as one compiled graph (`autotp serve --compile`).

A step whose rows each compute one token (decode without drafts or prompt log-probabilities) is the step
that repeats token after token, and much of its time is Python and op dispatch, not arithmetic. So that
step's whole forward, the paged attention included, is one graph (fullgraph=True); prefill chunks and
drafts stay eager. Compiling the decoder layers alone, with the attention left eager, was measured slower
than eager here (117 against 85 ms per token, SmolLM2-135M): the graph breaks and their guards cost more
than they save. Figures: benchmarks/compile_bench.py.

Inputs are padded to buckets so that a few shapes serve every batch: rows to a power of two, context to a
power-of-two number of blocks. One row is never padded to two: a (1, n) @ (n, m) product takes the
matrix-vector path, measured at half the time of a (2, n) one here (122 against 245 us for SmolLM2's
576 x 1536), and decode is mostly such products. Padding rows write their keys and values into the pool's
scratch slot, attend to its zero slot alone, and their scores are dropped. Row and context sizes are
dynamic in the graph: one graph serves a single row, another every bucket of two rows or more (a size-1
dimension is specialised); on CUDA each bucket is then recorded as a CUDA graph ("reduce-overhead").

Every rank compiles at start-up (`warm_up`: steps of padding rows only, which write nothing but the
scratch slot); the collectives inside are autotp's custom ops (parallel/collectives.py), in the same order
as eager's, so a rank that runs a step eager stays in lockstep with one that runs it compiled. After
warm-up a shape the graph's guards refuse runs eager rather than compiling again mid-serving (a minute
on a CPU): `eager_on_recompile`. Where compilation fails, the engine runs eager and says so in one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from autotp import compiler
from autotp.serve.runner.attention.sdpa import Group, SdpaStep
from autotp.serve.runner.attention.step import StepMeta, ship
from autotp.serve.runner.kv_cache import KvPool


def cache_dir() -> str:
    """Where inductor keeps what it compiled, so that a restart compiles again in less time."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache

    return inductor_cache()


def bucket(n: int) -> int:
    """The padded size of n rows: the next power of two."""
    return 1 << (n - 1).bit_length()


def decode_meta(pool: KvPool, tables: list[list[int]], starts: list[int], device, tokens: list[int] | None = None,
                extra: list[np.ndarray] = ()) -> tuple[StepMeta, int, torch.Tensor | None, list[torch.Tensor]]:
    """The padded description of a decode step: rows with block `tables` compute the token at positions `starts`.

    Returns it, its row count, bucket(rows), `tokens` padded to that count as the step's ids (1, rows) (None where
    not given) and the `extra` host arrays on the device: one short group (sdpa.Group) of one query per row, whose
    context is a power-of-two number of blocks; a padding row writes the scratch slot and sees the zero slot. Built
    on the host and copied once (step.ship)."""
    size, rows, real = pool.block_size, bucket(len(tables)), len(tables)
    blocks = 1 << (max(starts) // size).bit_length()  # a power of two > max(starts) // size
    table = np.zeros((rows, blocks), dtype=np.int64)
    for r, t in enumerate(tables):
        t = t[:blocks]
        table[r, :len(t)] = t
    slots = (table[:, :, None] * size + np.arange(size)).reshape(rows, -1)  # (rows, blocks * size)
    ends = np.array(starts + [0] * (rows - real))
    slots[np.arange(slots.shape[1])[None] > ends[:, None]] = pool.slots
    slots[real:, 0] = pool.slots  # a padding row sees the zero slot alone
    write = slots[np.arange(rows), ends]
    write[real:] = pool.scratch
    arrays = [write, ends, np.arange(rows), slots, np.array([(tokens or []) + [0] * (rows - len(tokens or []))])]
    shipped = ship([*arrays, *extra], device)
    # the graph's inputs each a tensor of its own: views of the one shipped buffer would alias one storage at offsets
    # that change with the shapes (a guard the graph could fail every step); device copies, no host wait
    write_t, ends_t, index, slots_t, ids = (t.clone() for t in shipped[:len(arrays)])
    visible = torch.arange(slots_t.shape[1], device=slots_t.device)[None] <= ends_t[:, None]
    group = Group(index[:, None], slots_t, visible[:, None, None, :], ends_t[:, None, None, None],
                  (ends_t + 1)[:, None])
    return (StepMeta(write_t, ends_t, SdpaStep([group])), rows, ids if tokens is not None else None,
            shipped[len(arrays):])


def _mark_dynamic(ids: torch.Tensor, meta: StepMeta) -> None:
    """The sizes that change from step to step: context columns, and rows where there are two or more. Only
    these: were every size dynamic (dynamic=True), a context of 64 columns would be unified with a head_dim
    of 64, then specialised with it."""
    group, = meta.attention.groups
    torch._dynamo.mark_dynamic(group.slots, 1)
    torch._dynamo.mark_dynamic(group.visible, 3)
    if ids.shape[1] > 1:
        for t, dim in ((ids, 1), (meta.slot_mapping, 0), (meta.positions, 0), (group.index, 0), (group.slots, 0),
                       (group.visible, 0), (group.qpos, 0), (group.lengths, 0)):
            torch._dynamo.mark_dynamic(t, dim)


class CompiledDecode:
    """forward(ids (1, rows), meta) -> logits (rows, vocab), compiled: one graph for every decode step."""

    def __init__(self, forward: Callable[[torch.Tensor, StepMeta], torch.Tensor], device: torch.device):
        mode = "reduce-overhead" if device.type == "cuda" else None
        self.forward = forward
        self.graph = torch.compile(forward, fullgraph=True, mode=mode)

    def warm_up(self, pool: KvPool, device) -> float:
        """Compile (every rank at once: the graph's collectives run); the seconds it took. Raises what the
        compiler raised, or that there is none (autotp.compiler, asked before tracing), after running the rest
        of the warm-up eager: a rank whose compiler failed still meets the others' collectives."""
        start, failure = time.perf_counter(), compiler.missing(device)
        for rows in (1, 2):  # four blocks of context: not 1, and not the rows' size
            meta, _, _, _ = decode_meta(pool, [[0] * 4] * rows, [3 * pool.block_size] * rows, device)
            meta.slot_mapping[:], meta.attention.groups[0].slots[:] = pool.scratch, pool.slots
            ids = torch.zeros(1, rows, dtype=torch.long, device=device)
            _mark_dynamic(ids, meta)
            with torch.no_grad():  # not inference_mode: inductor refuses inference tensors
                try:
                    if failure is None:
                        self.graph(ids, meta)
                        continue
                except Exception as e:  # noqa: BLE001 - whatever the compiler raised is reported, and eager serves
                    failure = e
                self.forward(ids, meta)
        if failure is not None:
            raise failure
        return time.perf_counter() - start

    def __call__(self, ids: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        with torch.no_grad(), torch.compiler.set_stance("eager_on_recompile"):
            return self.graph(ids, meta)
