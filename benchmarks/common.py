"""Shared by the benchmarks: the starcoderbase-1b-shaped checkpoint, wide random weights, RSS readings, ports.

The checkpoint has starcoderbase-1b's architecture (n_embd 2048, 16 heads multi-query, 24 layers,
n_inner 8192, vocab 49152, n_positions 8192) with random weights, made once and cached under
benchmarks/.cache/ (git-ignored). Nothing is downloaded.
"""

from __future__ import annotations

import json
import resource
import socket
from pathlib import Path

import torch

CACHE = Path(__file__).parent / ".cache"
STARCODERBASE_1B = dict(n_embd=2048, n_head=16, n_layer=24, n_inner=8192, vocab_size=49152, n_positions=8192,
                        multi_query=True, activation_function="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)


def starcoderbase_1b(dtype: str = "bfloat16") -> Path:
    """Directory of a random starcoderbase-1b-shaped safetensors checkpoint in `dtype` (made on first use)."""
    out = CACHE / f"starcoderbase-1b-{dtype}"
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import save_file
    from transformers import GPTBigCodeConfig

    from autotp.loading.skeleton import skeleton

    config = GPTBigCodeConfig(**STARCODERBASE_1B, dtype=dtype)
    net = skeleton(config, getattr(torch, dtype), buffers=False)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in net.named_parameters():  # tied lm_head is skipped: named_parameters() de-duplicates
        tensors[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    return out


def widen(model):
    """Wide random weights in place, from torch's global generator (matrices N(0, 0.3), vectors N(0, 0.1)),
    so greedy tokens depend on every slice; returns the model.

    The benchmarks' recipe, kept as it was when their results were recorded; tests/checkpoints.py has the
    tests' own (norms near 1). seed_repro/make_checkpoint.py writes this one inline: it runs in DeepSpeed
    0.11.1's venv and imports nothing from here."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.normal_(0, 0.1)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def merged(old, new):
    """new over old, key by key at every depth of dicts: what a run did not measure stays as it was."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: merged(old[k], v) if k in old else v for k, v in new.items()}}
    return new


def write_json(path: Path, data) -> None:
    """Writes data into the results file at path by merging (`merged`), not overwriting: a run of some parts
    or some configurations keeps the figures of the others, which RESULTS.md may still quote. A script whose
    runs are repeated keys each run (serve_bench's `runs`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(merged(old, data), indent=2) + "\n")
