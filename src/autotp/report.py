"""`autotp plan`: how every tensor of a model is partitioned across ranks, from config.json alone.

Builds the model on the meta device (no weights, no processes), applies the family's plan for every
rank, and reports each tensor's global shape, the slice or replication a rank holds, and its bytes.
When the directory also has safetensors files, their headers give the stored dtype and are checked
against the config, still without reading a weight.
"""

from __future__ import annotations

import re

import torch

from autotp.api import parse_dtype
from autotp.hub import load_config, resolve_model_dir
from autotp.layout import resolve
from autotp.loader import INDEX, SINGLE, Checkpoint
from autotp.plans import plan_for
from autotp.quant import INT4_GROUP, Quant
from autotp.skeleton import skeleton


def plan_report(model: str, tp: int, dtype: str | None = None, quantize: str | None = None,
                group_size: int = INT4_GROUP) -> dict:
    model_dir = resolve_model_dir(model, patterns=["config.json"])
    config = load_config(model_dir)
    plan = plan_for(config)
    has_weights = (model_dir / INDEX).exists() or (model_dir / SINGLE).exists()
    ckpt = Checkpoint(model_dir) if has_weights else None
    torch_dtype = parse_dtype(dtype) or (ckpt and ckpt.floating_dtype()) or _config_dtype(config)
    quant = Quant.parse(quantize, group_size)
    layout = resolve(skeleton(config, torch_dtype, buffers=False), plan, tp, ckpt, quant)
    ranks = []
    for rank, h in enumerate(layout.heads):
        tensors = [{"name": p.name, "tied": list(p.aliases), "shape": list(p.shape),
                    "holds": p.shards[rank].describe(len(p.shape)), "local_shape": list(p.local_shape(rank)),
                    "bytes": p.nbytes(rank),
                    "stored": p.quant.quant.kind if p.quant else str(p.dtype).removeprefix("torch.")}
                   for p in layout.params.values()]
        ranks.append({"rank": rank, "q_heads": [h.q_start, h.q_stop], "kv_heads": [h.kv_start, h.kv_stop],
                      "total_bytes": layout.rank_bytes(rank), "tensors": tensors})
    return {"model": str(model), "family": plan.family, "plan_source": plan.source, "tp": tp,
            "dtype": str(torch_dtype).removeprefix("torch."), "checkpoint_headers": ckpt is not None,
            "quantize": quantize, "group_size": group_size if quantize == "int4" else None,
            "num_heads": plan.num_heads, "num_kv_heads": plan.num_kv_heads, "ranks": ranks}


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_report(report: dict) -> str:
    """Text table per rank; identical tensors of different layers fold into one `h.*` row with a count."""
    lines = [f"{report['model']}: {report['family']} ({report['plan_source']} plan), tp={report['tp']}, "
             f"dtype={report['dtype']}, {report['num_heads']} query heads / {report['num_kv_heads']} KV heads"
             + (f", linear weights {report['quantize']}" if report["quantize"] else "")
             + (f" (groups of {report['group_size']})" if report["group_size"] else "")
             + ("" if report["checkpoint_headers"] else " [config only: no checkpoint headers read]")]
    for r in report["ranks"]:
        lines.append(f"\nrank {r['rank']}: query heads {r['q_heads'][0]}:{r['q_heads'][1]}, "
                     f"KV heads {r['kv_heads'][0]}:{r['kv_heads'][1]}, {_human(r['total_bytes'])}")
        folded: dict[tuple, list] = {}
        for t in r["tensors"]:
            key = (re.sub(r"\.\d+\.", ".*.", t["name"]), tuple(t["shape"]), t["holds"], tuple(t["local_shape"]),
                   t["stored"])
            folded.setdefault(key, []).append(t)
        width = max(len(k[0]) for k in folded) + 6
        for (name, shape, holds, local, stored), ts in folded.items():
            count = f" x{len(ts)}" if len(ts) > 1 else ""
            tied = f" (tied: {', '.join(ts[0]['tied'])})" if ts[0]["tied"] else ""
            lines.append(f"  {name + count:<{width}} {str(list(shape)):>16}  {holds:<36} "
                         f"{str(list(local)):>16}  {stored:>8}  {_human(sum(t['bytes'] for t in ts)):>10}{tied}")
    return "\n".join(lines)

