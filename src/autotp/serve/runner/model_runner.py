"""The model runner: this rank's requests (their block tables), one forward per step over every request's new tokens,
and, on the rank that samples, each request's next tokens (next_tokens.py).

Every rank changes its tables only by the steps rank 0 sends (`apply`) and runs each step the same way (`run`):
the requests' new tokens flattened into one (1, tokens) input with their positions, and the step's description
(attention/step.StepMeta) built once, here, before the forward, by the attention backend the server runs
(attention/backends.py). Only the positions rank 0 asked for reach the LM head (`logits_to_keep`): a sampling
request's last one, every one of a request that wants its prompt's log-probabilities or verifies a draft.

The index arithmetic is done on the host in numpy, and the step's index arrays (the sampler's among them) cross to
the device in one copy; the step then waits for the device once, where its tokens are read back (or, on a rank that
samples nothing, in `landed`). Nothing here decides anything; a forward that raises leaves its requests' new slots
half written, so rank 0 fails those requests on every rank alike and their blocks are never cached.

On a pipeline stage (parallel/stage_io.py) the forward takes the hidden states the stage before computed and, before
the last stage, gives its own instead of scores: `run` returns them, (tokens, hidden), for the next stage.
"""

from __future__ import annotations

import numpy as np
import torch

from autotp.parallel import stage_io
from autotp.serve.lockstep.step import Step, StepResult, Work
from autotp.serve.runner import adapters
from autotp.serve.runner.attention.step import StepLayout, StepMeta, ship
from autotp.serve.runner.compiled import CompiledDecode, decode_meta
from autotp.serve.runner.kv_cache import KvPool, StepCache
from autotp.serve.runner.next_tokens import NextTokens, Span
from autotp.serve.runner.probe import Implementation


def landed(logits: torch.Tensor) -> None:
    """Wait until the device has run the step. On CUDA a forward only queues its kernels and collectives: without
    this, a rank that dies or runs out of memory mid-step would leave the others blocked in their next host wait,
    outside the watchdog's window (lockstep/watchdog.py), until NCCL's timeout (10 minutes). The rank that samples
    waits where it reads its tokens back instead: one wait per step either way."""
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)


class ModelRunner:
    """One rank's requests. backend: the attention backend's entry (attention/backends.py), sized for the longest
    draft; samples: this rank turns the scores into tokens (rank 0)."""

    def __init__(self, model, pool: KvPool, backend, samples: bool = True):
        self.model, self.pool, self.backend = model, pool, backend
        self.device = model.device
        adapters.install(model)  # BLOOM, Falcon, MPT: their attention modules' paged forward (once per model)
        self.implementation = Implementation(model)
        self.stage = getattr(model, "autotp_stage", None)  # a pipeline stage's hooks (parallel/stage_io.py), or None
        self.tables: dict[int, list[int]] = {}
        self.dropped: set[int] = set()  # requests whose forward failed, until they end (`fail`)
        self.next_tokens = NextTokens(self.device) if samples else None
        self.graph: CompiledDecode | None = None  # compile()
        self.compiled: CompiledDecode | None = None  # the graph, once every rank has one (use_graph)

    def compile(self) -> float:
        """Compile the decode step (compiled.py); the seconds warm-up took. Every rank calls it at once; raises
        what the compiler raised. Decode steps take the graph once every rank has it (`use_graph`)."""
        self.graph = CompiledDecode(self._forward, self.device)
        return self.graph.warm_up(self.pool, self.device)

    def use_graph(self) -> None:
        self.compiled = self.graph

    def requests(self) -> list[int]:
        return list(self.tables)

    def apply(self, step: Step) -> None:
        """The step's bookkeeping, before its forward: ended requests go, new ones come, tables grow, blocks copy."""
        for request in step.finished:
            self.tables.pop(request, None)
            self.dropped.discard(request)
            if self.next_tokens is not None:
                self.next_tokens.drop(request)
        if self.next_tokens is not None:
            for new in step.new:
                self.next_tokens.add(new)
        for w in step.work:
            if w.id not in self.dropped:
                self.tables.setdefault(w.id, []).extend(w.blocks)
        copies = [w.copy for w in step.work if w.copy]
        if copies:  # before the forward: a block another request takes this step is written only by the forward
            self.pool.copy(copies)

    def run(self, step: Step, received: torch.Tensor | None = None,
            without: tuple[int, ...] = ()) -> StepResult | torch.Tensor | None:
        """The step's forward, then (on the rank that samples) its requests' next tokens; on a pipeline stage before
        the last, the hidden states (tokens, hidden) it hands on, of the requests `handed` gives. received: what the
        stage before handed on, the step's tokens but those of the requests `without` (whose forward failed there).
        Raises what the forward raised, with its requests' tables already gone."""
        work = self.handed(step)
        if not work:  # every request of it failed before (the step still ran on a stage where they had not)
            return StepResult() if self.next_tokens is not None else None
        if received is not None and len(work) + len(without) < len(step.work):  # failed here, not there: rows go
            rows, at = [], 0
            for w in step.work:
                if w.id not in without:
                    rows += range(at, at + len(w.tokens)) if w.id not in self.dropped else []
                    at += len(w.tokens)
            received = received[rows]
        if received is not None:  # it crossed through host memory (links.py): onto this rank's device, queued
            received = received.to(self.device, non_blocking=True)
        try:
            return self._run(work, received)
        except BaseException:
            self.fail(step)
            raise

    def handed(self, step: Step) -> tuple[Work, ...]:
        """The step's work this rank runs: a request whose forward failed is passed over until it ends (`fail`)."""
        return tuple(w for w in step.work if w.id not in self.dropped)

    def without(self, step: Step) -> tuple[int, ...]:
        """The step's requests this rank passes over (`handed`): the next stage receives no hidden states of theirs."""
        return tuple(w.id for w in step.work if w.id in self.dropped)

    def fail(self, step: Step) -> None:
        """The step's forward failed (here, or on a stage before this one): its requests' tables go, and a later chunk
        of their prompts, in flight already (a pipeline's), is passed over until they end."""
        for w in step.work:
            self.tables.pop(w.id, None)
            self.dropped.add(w.id)

    def _spans(self, work: tuple[Work, ...]) -> tuple[list[int], list[int], list[Span]]:
        """The step's flattened token ids, the positions the LM head keeps, and each request's span of them."""
        ids, keep, spans = [], [], []
        for w in work:
            a, n = len(ids), len(w.tokens)
            ids += w.tokens
            if w.every or w.sample:
                first = a if w.every else a + n - 1
                spans.append(Span(w.id, w.start + first - a, len(keep), len(keep) + a + n - first, w.sample,
                                  w.tokens[n - w.draft:] if w.draft else ()))
                keep += range(first, a + n)
        return ids, keep, spans

    def _run(self, work: tuple[Work, ...], received: torch.Tensor | None) -> StepResult | torch.Tensor | None:
        ids, keep, spans = self._spans(work)
        plan = self.next_tokens.plan(spans) if self.next_tokens is not None else None
        extra = plan.arrays() if plan is not None else []
        if self.compiled is not None and all(len(w.tokens) == 1 and w.sample and not w.every for w in work):
            # a decode step through the compiled graph: one row per request, padded to its bucket
            meta, _, ids_t, shipped = decode_meta(self.pool, [self.tables[w.id] for w in work],
                                                  [w.start for w in work], self.device, ids, extra)
            logits = self.compiled(ids_t, meta)
        else:
            meta, (ids_t, keep_t, *shipped) = self.describe(work, [np.array([ids]), np.array(keep), *extra])
            with torch.inference_mode():
                logits = self._forward(ids_t, meta, keep_t, received)
        if self.stage is not None and not self.stage.last:
            return logits  # the hidden states, for the next stage
        if plan is None or not spans:  # nothing to read back: wait for the device here
            landed(logits)
            return None if plan is None else StepResult()
        with torch.inference_mode():
            return self.next_tokens.take(logits, plan, *shipped)

    def describe(self, work: tuple[Work, ...], extra: list[np.ndarray] = ()) -> tuple[StepMeta, list[torch.Tensor]]:
        """The step's description, built once before its forward by the server's attention backend from the requests'
        layout; `extra` host arrays cross to the device in the same copy and come back as tensors."""
        layout = StepLayout([self.tables[w.id] for w in work], np.array([w.start for w in work]),
                            np.array([len(w.tokens) for w in work]), self.pool.block_size, self.pool.num_blocks)
        arrays, build = self.backend.describe(layout)
        slots, positions, *rest = ship([layout.slots, layout.positions, *arrays, *extra], self.device)
        return StepMeta(slots, positions, build(rest[:len(arrays)])), rest[len(arrays):]

    def _forward(self, ids: torch.Tensor, meta: StepMeta, keep: torch.Tensor | int = 0,
                 received: torch.Tensor | None = None) -> torch.Tensor:
        """ids (1, tokens) -> the scores (kept, vocab) of the positions `keep` (0: every position); before a
        pipeline's last stage, the hidden states (tokens, hidden) of its last layer, `received` (tokens, hidden)
        entering its first. The caller chooses the grad mode: inference_mode eager, no_grad compiled (inductor
        refuses inference tensors)."""
        cache = StepCache(self.pool, meta, ids.shape[1])
        self.implementation.set()  # for this forward only
        try:
            out = stage_io.forward(self.model, lambda: self.model(
                input_ids=ids, position_ids=meta.positions[None], cache=cache, use_cache=True, logits_to_keep=keep,
                paged=cache), None if received is None else received[None])
        finally:
            self.implementation.restore()
        return out[0] if isinstance(out, torch.Tensor) else out.logits[0]
