"""`autotp serve` on many checkpoints in one torchrun: for each, `autotp.cli.main(["serve", ...])` as
`python -m autotp serve` runs it, while a thread on rank 0 asks it for a greedy completion (whole and
streamed) through the openai client and then signals rank 0 to stop, as an operator's SIGTERM would
(serve_each.py). Rank 0 writes OUT/NAME.json = {"code", "answers": {"text", "streamed"}, "stderr"}.

    torchrun --nproc-per-node N family_serve.py OUT PROMPT TOKENIZER NAME=DIR...
"""

import os
import sys
from pathlib import Path

import openai
from serve_each import serve_each

out, prompt, tokenizer, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]


def ask(url: str, directory: str, answers: dict) -> None:
    """A greedy completion, whole and streamed, through the openai client."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = os.path.basename(directory)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    answers["text"] = whole.choices[0].text
    answers["streamed"] = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True) if c.choices)


# float32: HF's float32 is the oracle, on a CPU with native bfloat16 too. A KV cache of 64 MiB: a family without a
# context limit (BLOOM) is otherwise given half the host's available memory (5.5 GiB per rank on a 24 GiB host, 15 s
# of page faults and most of the host's memory for one 2-rank test server)
serve_each(out, rest, ["--tokenizer", tokenizer, "--dtype", "float32", "--kv-cache-memory", "64MiB"], ask, 120)
