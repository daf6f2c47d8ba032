"""One rank of the load benchmark (run by load_memory.py under torchrun): load, one forward, a generate of 8
prompt tokens and 4 new ones (as `autotp generate`), write
$BENCH_OUT/rank{RANK}.json."""

import json
import os
import sys
import time

import torch
from common import current_rss_mib, peak_rss_mib

mode = sys.argv[1]
if mode == "idle":  # what importing the stack costs, the baseline of the memory target: torch, autotp and
    # transformers with the model's class (which pulls in the generation code); no model is built
    from transformers import GPTBigCodeForCausalLM  # noqa: F401

    import autotp  # noqa: F401

    report = {"rank": 0, "idle_rss_mib": peak_rss_mib()}
    with open(os.path.join(os.environ["BENCH_OUT"], "rank0.json"), "w") as f:
        json.dump(report, f)
    sys.exit(0)

import autotp  # noqa: E402

start = time.perf_counter()
model = autotp.from_pretrained(mode)
load_s = time.perf_counter() - start
load_peak, after_load = peak_rss_mib(), current_rss_mib()
with torch.no_grad():
    model(torch.tensor([[1, 2, 3, 4]]))
forward_peak = peak_rss_mib()
from autotp.generate import generate  # noqa: E402

generate(model, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), max_new_tokens=4)  # what `autotp generate` adds
rank = int(os.environ.get("RANK", 0))
report = {
    "rank": rank,
    "load_s": round(load_s, 2),
    "param_mib": round(model.autotp.param_bytes / 2**20, 1),
    "read_mib": round(model.autotp.bytes_read / 2**20, 1),
    "peak_rss_load_mib": round(load_peak, 1),
    "rss_after_load_mib": round(after_load, 1),
    "peak_rss_forward_mib": round(forward_peak, 1),
    "peak_rss_generate_mib": round(peak_rss_mib(), 1),
}
with open(os.path.join(os.environ["BENCH_OUT"], f"rank{rank}.json"), "w") as f:  # ranks' stdout interleaves
    json.dump(report, f)
