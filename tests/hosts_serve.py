"""`autotp serve --pp PP` on checkpoints in turn, as one host's part of a torchrun across (simulated) hosts: for each,
`autotp.cli.main(["serve", ...])` as `python -m autotp serve` runs it, while a thread on rank 0 (on the first host)
asks it, then signals rank 0 to stop, as an operator's SIGTERM would (serve_each.py). Rank 0 writes OUT/NAME.json =
{"code", "answers", "stderr"}; the answers:
- "cold": PROMPT, greedy, 12 tokens, with each token's log-probability (OpenAI's /v1/completions);
- "again": the same prompt again through llama-server's /completion, its blocks from the prefix cache (cache_n);
- "long": a 40-token prompt (three chunks of 16 tokens) streamed, and "joiner": a short prompt sent once the long
  one's first token came, so that it joins the running batch;
- "repeat": a prompt that repeats itself, whose prompt-lookup drafts are verified through the stages.

    torchrun --nnodes H ... hosts_serve.py OUT TOKENIZER PP NAME=DIR...
"""

import json
import os
import sys
import threading
import urllib.request
from pathlib import Path

from serve_each import serve_each

out, tokenizer, pp, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]

PROMPT = "w3 w17 w42 w8 w99 w51 w23"
LONG = " ".join(f"w{(7 * i) % 97}" for i in range(40))
JOINER = "w60 w61 w62"
REPEAT = " ".join(["w5 w6 w7 w8 w9"] * 5)
MODEL = [""]  # the name the server answers to: its directory's


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def completion(url: str, prompt: str, n: int, logprobs: bool = False) -> dict:
    body = post(url + "/v1/completions", {"model": MODEL[0], "prompt": prompt, "max_tokens": n, "temperature": 0,
                                          **({"logprobs": 1} if logprobs else {})})
    choice = body["choices"][0]
    return {"text": choice["text"], "logprobs": (choice["logprobs"] or {}).get("token_logprobs")}


def streamed(url: str, prompt: str, n: int, first: threading.Event, answers: dict, name: str) -> None:
    body = json.dumps({"model": MODEL[0], "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
                first.set()
    answers[name] = {"text": "".join(text)}


def ask(url: str, directory: str, answers: dict) -> None:
    MODEL[0] = os.path.basename(directory)
    answers["cold"] = completion(url, PROMPT, 12, logprobs=True)
    again = post(url + "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "cache_prompt": True})
    answers["again"] = {"text": again["content"], "cache_n": again["timings"]["cache_n"]}
    first = threading.Event()
    long = threading.Thread(target=streamed, args=(url, LONG, 16, first, answers, "long"))
    long.start()
    first.wait(120)
    answers["joiner"] = completion(url, JOINER, 10)
    long.join()
    answers["repeat"] = completion(url, REPEAT, 16)


# float32: HF's float32 is the oracle. 16 tokens per step: the 40-token prompt goes in three chunks
serve_each(out, rest, ["--tokenizer", tokenizer, "--pp", pp, "--dtype", "float32", "--kv-cache-memory", "16MiB",
                       "--max-num-batched-tokens", "16", "--max-num-seqs", "4"], ask, 180)
