"""What the input guard (autotp.parallel.input_guard) costs a decode step: starcoderbase-1b shape, bf16, tp 2 on CPU.

Run under torchrun; rank 0 prints the table and writes benchmarks/results/guard_cost.json:

    OMP_NUM_THREADS=1 PYTHONPATH=benchmarks torchrun --nproc-per-node 2 benchmarks/guard_cost.py

Two measurements, same processes, same threads:
- the guard alone: its pre-hook (fingerprint + one 16-byte all-reduce) called HOOK_CALLS times on a decode
  step's input, mean microseconds per call;
- end to end: ROUNDS alternating rounds of STEPS greedy decode steps on the KV cache, with the guard and
  without it (the same model, its hook removed and put back), median ms/token of each.
"""

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import starcoderbase_1b, write_json

import autotp
from autotp.parallel.input_guard import InputGuard

STEPS, ROUNDS, HOOK_CALLS = 16, 5, 500


def decode_ms(model) -> float:
    prompt = (torch.arange(32).unsqueeze(0) * 37 + 11) % 1000
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(STEPS):
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) * 1e3 / STEPS


def main() -> None:
    model = autotp.from_pretrained(starcoderbase_1b("bfloat16"), check_inputs=False)
    guard = InputGuard(dist.group.WORLD, torch.device("cpu"))
    token = torch.tensor([[7]])
    for _ in range(20):
        guard(model, (), {"input_ids": token})
    start = time.perf_counter()
    for _ in range(HOOK_CALLS):
        guard(model, (), {"input_ids": token})
    hook_us = (time.perf_counter() - start) * 1e6 / HOOK_CALLS

    decode_ms(model)  # warm-up
    with_guard, without = [], []
    for _ in range(ROUNDS):
        without.append(decode_ms(model))
        handle = model.register_forward_pre_hook(guard, with_kwargs=True)
        with_guard.append(decode_ms(model))
        handle.remove()
    on, off = statistics.median(with_guard), statistics.median(without)
    if dist.get_rank() == 0:
        result = {"tp": dist.get_world_size(), "threads_per_rank": torch.get_num_threads(),
                  "hook_us": round(hook_us, 1),
                  "decode_ms_with_guard": round(on, 2), "decode_ms_without": round(off, 2),
                  "hook_share_of_step_pct": round(100 * hook_us / 1e3 / off, 3),
                  "end_to_end_change_pct": round(100 * (on - off) / off, 2),
                  "rounds_with": [round(x, 2) for x in with_guard], "rounds_without": [round(x, 2) for x in without]}
        print("starcoderbase-1b shape, bf16, tp", result["tp"], "threads/rank", result["threads_per_rank"])
        print(f"{'guard hook alone':<28}{hook_us:>10.1f} us/call = {result['hook_share_of_step_pct']:.3f} % of a step")
        print(f"{'decode without guard':<28}{off:>10.2f} ms/token (median of {ROUNDS})")
        print(f"{'decode with guard':<28}{on:>10.2f} ms/token ({result['end_to_end_change_pct']:+.2f} %)")
        write_json(Path(__file__).parent / "results" / "guard_cost.json", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
