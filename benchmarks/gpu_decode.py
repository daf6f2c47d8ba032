"""Decode ms/token on GPUs: plain HF, autotp, and `autotp serve`'s step eager and compiled, a
StarCoder-15.5B-shaped random bf16 model.

    python benchmarks/gpu_decode.py [--batch 1 16] [--new-tokens 32] [--runs 5] [--systems hf autotp engine compiled]
                                    [--attention sdpa flex varlen]
    torchrun --nproc-per-node 4 benchmarks/gpu_decode.py      # tp 4: autotp's systems only

The model is built on each rank's GPU from its config with random weights (no checkpoint files, ~31 GB of
HBM; every rank draws the same ones), timed as plain HF (tp 1 only), then sharded in place by
`autotp.init_inference` and timed through HF's cache ("autotp"), then through the serve engine's paged
step ("engine": serve/runner.py, the forward `autotp serve` runs, no scheduler or HTTP), then through
its compiled step ("compiled": serve/compiled.py, CUDA graphs; its warm-up seconds printed), each under
every attention backend asked for ("engine/flex": serve/runner/flex.py; "engine/varlen": serve/runner/varlen.py,
in blocks of varlen.PAGE_MULTIPLE tokens, the others in blocks of 16; compiled decode steps keep sdpa, so
"compiled" runs once, its prefill under each backend not timed). Beside
each number is the HBM floor: this rank's weight bytes / the device-to-device copy bandwidth measured
here, the time one decode step needs just to read every weight once. Writes
benchmarks/results/gpu_decode.json. One prepared run of a few minutes; fails at once without CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
# bigcode/starcoder: 40 layers, 48 query heads, multi-query, n_embd 6144, 4x MLP, vocab 49152.
STARCODER_15B = dict(n_embd=6144, n_head=48, n_layer=40, n_inner=24576, vocab_size=49152, n_positions=8192,
                     multi_query=True, activation_function="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)


SYSTEMS = ("hf", "autotp", "engine", "compiled")


def copy_bandwidth_gbs(mib: int = 2048, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s; a copy reads and writes each byte, so 2 x size moves."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    del src, dst
    return 2 * mib * 2**20 / seconds / 1e9


def decode_ms(model, batch: int, prompt_len: int, new_tokens: int, runs: int) -> float:
    """Median over `runs` (after one warm-up) of ms per single-token decode step on a KV cache, greedy."""
    prompt = torch.randint(0, 1000, (batch, prompt_len), device="cuda")
    times = []
    for i in range(runs + 1):
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(new_tokens):
                out = model(token, cache=out.past_key_values, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        if i:  # the first run is the warm-up (cuBLAS heuristics, allocator growth)
            times.append((time.perf_counter() - start) * 1e3 / new_tokens)
    return statistics.median(times)


def engine_ms(runner, rows: int, prompt_len: int, new_tokens: int, runs: int) -> float:
    """The same for the serve engine's paged step: `rows` greedy requests prefilled in one step, then `new_tokens`
    decode steps, each request's next token read back as the server reads it (one host sync per step). Every rank
    runs the same steps (no scheduler)."""
    from autotp.sampling.rules import SamplingParams
    from autotp.serve.lockstep.step import NewRequest, Step, Work

    size = runner.pool.block_size
    blocks = -(-(prompt_len + new_tokens + 1) // size)
    prompt = torch.randint(0, 1000, (rows, prompt_len), generator=torch.Generator().manual_seed(1)).tolist()
    times = []
    for i in range(runs + 1):
        ids = range(i * rows, (i + 1) * rows)  # new requests each run
        step = Step(new=tuple(NewRequest(id=r, sampling=SamplingParams()) for r in ids),
                    work=tuple(Work(id=r, tokens=tuple(prompt[r % rows]), start=0,
                                    blocks=tuple(range(r % rows * blocks, (r % rows + 1) * blocks)), sample=True,
                                    every=False) for r in ids))
        runner.apply(step)
        tokens = runner.run(step).sampled
        torch.cuda.synchronize()
        start = time.perf_counter()
        for n in range(new_tokens):
            step = Step(work=tuple(Work(id=r, tokens=tokens[r].tokens, start=prompt_len + n, blocks=(), sample=True,
                                        every=False) for r in ids))
            runner.apply(step)
            tokens = runner.run(step).sampled
        torch.cuda.synchronize()
        runner.apply(Step(finished=tuple(ids)))
        if i:
            times.append((time.perf_counter() - start) * 1e3 / new_tokens)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--attention", nargs="+", choices=["sdpa", "flex", "varlen"],
                        default=["sdpa", "flex", "varlen"],
                        help="the serve step's attention backends to time (engine: each; compiled: the first)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_decode.py needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False); "
                 "the CPU comparison is benchmarks/compare.py")
    os.environ.setdefault("WORLD_SIZE", "1")  # one process, no launcher: autotp treats it as tp 1
    from common import write_json
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    import autotp
    from autotp.serve.engine.scheduler import Limits
    from autotp.serve.runner.attention.backends import check_model, choose
    from autotp.serve.runner.attention.varlen import PAGE_MULTIPLE
    from autotp.serve.runner.probe import probe
    from autotp.serve.server import parts

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    config = GPTBigCodeConfig(**STARCODER_15B)
    with torch.device("cuda"):  # built on the GPU directly: no 31 GB host copy, no checkpoint files
        model = GPTBigCodeForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    bandwidth = copy_bandwidth_gbs()
    rows = []

    def report(system: str, batch: int, ms: float) -> None:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # this rank's
        floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
        rows.append({"system": system, "tp": tp, "batch": batch, "decode_ms_per_token": round(ms, 2),
                     "hbm_floor_ms": round(floor_ms, 2), "x_floor": round(ms / floor_ms, 2)})
        if rank == 0:
            print(f"{system:>12} tp {tp} batch {batch:>3}: {ms:7.2f} ms/token  (HBM floor {floor_ms:.2f} ms, "
                  f"{ms / floor_ms:.2f}x)", flush=True)

    if tp == 1 and "hf" in args.systems:
        for batch in args.batch:
            report("hf", batch, decode_ms(model, batch, args.prompt_len, args.new_tokens, args.runs))
    model = autotp.init_inference(model, mp_size=tp, dtype=torch.bfloat16, device="cuda").module
    if "autotp" in args.systems:
        for batch in args.batch:
            report("autotp", batch, decode_ms(model, batch, args.prompt_len, args.new_tokens, args.runs))
    def limits(block: int) -> Limits:  # room for every row's blocks
        return Limits(max(args.batch), 8192, max(args.batch) * -(-(args.prompt_len + args.new_tokens + 32) // block)
                      * block)

    needs: set[str] = set()
    shapes = probe(model, needs)
    warm = None
    if "engine" in args.systems:
        for attention in args.attention:
            block = PAGE_MULTIPLE if attention == "varlen" else 16
            # a torch without the backend, or a model it cannot run, fails here in one line
            check_model(choose(attention, torch.device("cuda"), block), needs, shapes)
            runner, _ = parts(model, shapes, limits(block), block, False, attention=attention)
            for batch in args.batch:
                report(f"engine/{attention}", batch, engine_ms(runner, batch, args.prompt_len, args.new_tokens,
                                                               args.runs))
            del runner  # its KV pool
    if "compiled" in args.systems:
        runner, _ = parts(model, shapes, limits(16), 16, False, attention="sdpa")
        warm = runner.compile()
        runner.use_graph()
        if rank == 0:
            print(f"compiled the decode step in {warm:.1f} s", flush=True)
        for batch in args.batch:
            report("compiled", batch, engine_ms(runner, batch, args.prompt_len, args.new_tokens, args.runs))
    if rank != 0:
        return
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tp": tp,
              "compile_warm_up_s": None if warm is None else round(warm, 1),
              "copy_bandwidth_gbs": round(bandwidth, 1),
              "attention": args.attention, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "runs": args.runs, "rows": rows}
    write_json(HERE / "results" / f"gpu_decode{'' if tp == 1 else f'_tp{tp}'}.json", result)


if __name__ == "__main__":
    main()
