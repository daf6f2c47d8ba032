"""One rank of the quantization benchmark (run by quant_bench.py under torchrun): load the checkpoint with
`quantize` (argv: checkpoint dir, bf16 | int8 | int4, rounds), then time greedy decode at batch 1, a 512-token
prefill and batch-16 decode on the KV cache; write $BENCH_OUT/rank{RANK}.json (ranks' stdout interleaves).

Peak RSS is read twice: at the end of load (VmHWM), then VmHWM is reset (/proc/self/clear_refs) so that the
run peak covers the timed phases alone. Decode medians are over `rounds`; the prefill is timed once (it is long).
"""

import json
import os
import statistics
import sys
import time

import torch
from common import current_rss_mib, peak_rss_mib

import autotp

PROMPT, STEPS, PREFILL, BATCH, BATCH_PROMPT, BATCH_STEPS = 16, 16, 512, 16, 4, 8


def prompt(batch: int, length: int) -> torch.Tensor:
    return (torch.arange(batch * length).view(batch, length) * 37 + 11) % 1000


def forward(model, ids, past=None):
    out = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1), out.past_key_values


def decode_ms(model, batch: int, length: int, steps: int) -> float:
    """ms per decode step of `batch` sequences after a `length`-token prefill (the prefill is not timed)."""
    token, past = forward(model, prompt(batch, length))
    start = time.perf_counter()
    for _ in range(steps):
        token, past = forward(model, token, past)
    return (time.perf_counter() - start) * 1e3 / steps


def prefill_ms(model) -> float:
    start = time.perf_counter()
    forward(model, prompt(1, PREFILL))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ckpt, mode, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    start = time.perf_counter()
    model = autotp.from_pretrained(ckpt, quantize=None if mode == "bf16" else mode)
    load_s = time.perf_counter() - start
    load_peak, after_load = peak_rss_mib(), current_rss_mib()
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS
        f.write("5")
    with torch.no_grad():
        decode_ms(model, 1, PROMPT, 4)  # warm-up
        decode1 = [decode_ms(model, 1, PROMPT, STEPS) for _ in range(rounds)]
        prefill = [prefill_ms(model)]  # one: a 512-token prefill takes 10-100 s here
        decode16 = [decode_ms(model, BATCH, BATCH_PROMPT, BATCH_STEPS) for _ in range(rounds)]
    with open("/proc/self/status") as f:
        run_peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    rank = int(os.environ.get("RANK", 0))
    report = {
        "rank": rank, "mode": mode, "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
        "param_mib": round(model.autotp.param_bytes / 2**20, 1),
        "peak_rss_load_mib": round(load_peak, 1), "rss_after_load_mib": round(after_load, 1),
        "peak_rss_run_mib": round(run_peak, 1),
        "decode_ms": round(statistics.median(decode1), 2), "prefill_ms": round(statistics.median(prefill), 1),
        "decode16_ms": round(statistics.median(decode16), 2),
        "rounds": {"decode": [round(x, 2) for x in decode1], "prefill": [round(x, 1) for x in prefill],
                   "decode16": [round(x, 2) for x in decode16]},
    }
    with open(os.path.join(os.environ["BENCH_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
