"""Two hosts joined by a slow link: tensor parallelism across it (tp 2) against a pipeline of two stages (pp 2).

Two simulated hosts on this machine (tests/netns.py: network namespaces on a bridge, each with its own hostname),
each pinned to one core (taskset, OMP_NUM_THREADS=1) so that they compute side by side as two machines would, their
link limited by `tc ... tbf` (100 Mbit/s by default: this CPU computes a prompt far slower than GPUs, so the link is
slowed to keep the wire's share of a prompt what 1-10 GbE gives GPUs). On it, `torchrun --nnodes 2 --nproc-per-node 1
... -m autotp serve` with SmolLM2-135M in float32, --speculate 0 --no-prefix-caching, and either no --pp (tp 2: two
all-reduces per layer cross the link) or --pp 2 (one hidden state per token crosses it). Both with
--max-num-batched-tokens 256: a 2,000-token prompt goes in 8 chunks, which a pipeline's stages compute side by side.

Per system and link rate:
- first token of a ~2,000-token prompt (a streamed completion's first event), the median of --repeats;
- bytes on the link per prompt token: what host b's interface sent and received during that request, per token;
- decode tokens/s at concurrency 8 and 1: that many streamed completions of 64 tokens of short prompts at once,
  their tokens after each one's first over the time from the first of them to the last.
And a table worked out on paper: StarCoder-15.5B (40 layers, hidden 6,144, bf16) on 2 hosts x 2 GPUs at 1, 10 and
25 GbE, tp 4 across the hosts against pp 2 x tp 2: bytes on the link and its time per prompt token, and the waits
on it, one after the other, per decoded token.

    python benchmarks/pp_bench.py [--rates 100mbit 1gbit] [--systems tp2 pp2] [--run LABEL]

Needs root (namespaces). Prints the tables, merges them into benchmarks/results/pp_bench.json under runs/RUN.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from common import CACHE, free_port, write_json
from servers import smollm2

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from health import healthy  # noqa: E402
from netns import Hosts, available  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "pp_bench.json"
SYSTEMS = {"tp2": [], "pp2": ["--pp", "2"]}
PROMPT_TOKENS = 2000
DECODE_TOKENS = 64
FLAGS = ["--dtype", "float32", "--speculate", "0", "--no-prefix-caching", "--max-num-batched-tokens", "256",
         "--kv-cache-memory", "256MiB", "--max-num-seqs", "8"]


def serve(hosts: Hosts, system: str, model: Path, logs: Path) -> tuple[list, str]:
    port, http = free_port(), free_port()
    procs = []
    for i in range(2):
        argv = ["taskset", "-c", str(i), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr", hosts.addr(0), "--master-port",
                str(port), "-m", "autotp", "serve", "--model", str(model), "--host", "0.0.0.0", "--port", str(http),
                "--allowed-hosts", "*", *FLAGS, *SYSTEMS[system]]
        procs.append(hosts.run(i, argv, logs / f"{system}-host{i}.log", env={"OMP_NUM_THREADS": "1"}))
    url = f"http://{hosts.addr(0)}:{http}"
    if not healthy(url, 600, procs, every_s=0.5):
        raise RuntimeError((logs / f"{system}-host0.log").read_text()[-3000:])
    return procs, url


def stream(url: str, model: str, prompt, max_tokens: int) -> dict:
    """One streamed completion: when it was sent, when each event came."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    sent, times = time.monotonic(), []
    with urllib.request.urlopen(request, timeout=1800) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
    return {"sent": sent, "times": times}


def first_token(url: str, model: str, ids: list[int], hosts: Hosts, repeats: int) -> dict:
    firsts, per_token = [], []
    for k in range(repeats):
        prompt = ids[k:] + ids[:k]  # a prompt of its own each time
        before = hosts.traffic(1)
        got = stream(url, model, prompt, 1)
        firsts.append(got["times"][0] - got["sent"])
        per_token.append((hosts.traffic(1) - before) / len(prompt))
    return {"first_token_s": statistics.median(firsts), "all_s": firsts,
            "link_bytes_per_prompt_token": statistics.median(per_token)}


def decode(url: str, model: str, prompts: list[list[int]]) -> dict:
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = stream(url, model, prompts[i], DECODE_TOKENS)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start, end = min(o["times"][0] for o in out), max(o["times"][-1] for o in out)
    tokens = sum(len(o["times"]) - 1 for o in out)
    return {"tokens_per_s": tokens / (end - start), "tokens": tokens, "seconds": end - start}


def measure(system: str, rate: str, model: Path, ids: list[int], logs: Path, repeats: int) -> dict:
    with Hosts(2, rate) as hosts:
        procs, url = serve(hosts, system, model, logs)
        name = model.name
        stream(url, name, ids[:32], 4)  # warm-up
        row = {"rate": rate, "system": system} | first_token(url, name, ids, hosts, repeats)
        for concurrency in (8, 1):
            prompts = [ids[100 * i: 100 * i + 16] for i in range(concurrency)]
            row[f"decode_c{concurrency}"] = decode(url, name, prompts)
        return row


def on_paper() -> list[dict]:
    """StarCoder-15.5B, bf16, on 2 hosts x 2 GPUs: what crosses the link between the hosts.

    tp 4 across the hosts: 2 all-reduces per layer of the token's hidden state (6,144 x 2 bytes). A ring all-reduce
    over 4 ranks sends 2 (4 - 1) / 4 = 1.5 x its size along each edge, and two of the ring's edges cross between the
    hosts, one each way: 1.5 x 12 KiB each way per all-reduce; its 2 (4 - 1) = 6 steps each wait on those edges, so a
    decoded token waits on the link 80 x 6 times in turn. pp 2 x tp 2: one hidden state per token crosses, once
    (stage 0 to stage 1), and the sampled tokens come back: 2 waits per decoded token.
    """
    layers, hidden, itemsize = 40, 6144, 2
    tp_bytes = layers * 2 * 1.5 * hidden * itemsize  # each way, per token
    pp_bytes = hidden * itemsize
    rows = []
    for gbe in (1, 10, 25):
        per_s = gbe * 1e9 / 8
        rows.append({"link_gbe": gbe, "tp4_bytes_per_token_each_way": tp_bytes,
                     "pp2tp2_bytes_per_token_each_way": pp_bytes,
                     "tp4_ms_per_prompt_token": 1e3 * tp_bytes / per_s,
                     "pp2tp2_ms_per_prompt_token": 1e3 * pp_bytes / per_s,
                     "tp4_s_per_2000_token_prompt": 2000 * tp_bytes / per_s,
                     "pp2tp2_s_per_2000_token_prompt": 2000 * pp_bytes / per_s,
                     "tp4_link_waits_per_decoded_token": layers * 2 * 6,
                     "pp2tp2_link_waits_per_decoded_token": 2})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--run", default="default")
    args = parser.parse_args()
    why = available()
    if why:
        print(f"pp_bench: {why}", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    model = smollm2()
    text = (ROOT / "README.md").read_text() * 4
    ids = AutoTokenizer.from_pretrained(model)(text).input_ids[:args.prompt_tokens]
    logs = CACHE / "pp_bench_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for rate in args.rates:
        for system in args.systems:
            rows.append(measure(system, rate, model, ids, logs, args.repeats))
            r = rows[-1]
            print(f"{rate:>8} {system}: first token {r['first_token_s']:.2f} s, "
                  f"{r['link_bytes_per_prompt_token']:.0f} link bytes per prompt token, decode "
                  f"{r['decode_c8']['tokens_per_s']:.1f} tok/s at 8, {r['decode_c1']['tokens_per_s']:.1f} at 1",
                  flush=True)
    paper = on_paper()
    print("\nStarCoder-15.5B on 2 hosts x 2 GPUs (bf16), on paper:")
    for p in paper:
        print(f"{p['link_gbe']:>3} GbE: tp 4 {p['tp4_ms_per_prompt_token']:.3f} ms/prompt token "
              f"({p['tp4_s_per_2000_token_prompt']:.2f} s per 2,000), pp 2 x tp 2 "
              f"{p['pp2tp2_ms_per_prompt_token']:.4f} ms ({p['pp2tp2_s_per_2000_token_prompt']:.3f} s); waits on "
              f"the link per decoded token {p['tp4_link_waits_per_decoded_token']} vs "
              f"{p['pp2tp2_link_waits_per_decoded_token']}")
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    data["runs"][args.run] = {"prompt_tokens": len(ids), "decode_tokens": DECODE_TOKENS, "flags": FLAGS,
                              "rows": rows, "starcoder_on_paper": paper}
    write_json(RESULTS, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
