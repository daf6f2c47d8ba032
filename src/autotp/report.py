"""`autotp plan`: how every tensor of a model is partitioned across ranks, from config.json alone.

Prepares the model as loading would (`autotp.prepare`: a meta skeleton, no weights, no processes) and
reports, for every rank, each tensor's global shape, the slice or replication the rank holds, and its
bytes. When the directory also has safetensors files, their headers give the stored dtype and are
checked against the config, still without reading a weight.
"""

from __future__ import annotations

import re

from autotp.hub import resolve_model_dir
from autotp.prepare import prepare
from autotp.quant.weights import INT4_GROUP


def plan_report(model: str, tp: int, dtype: str | None = None, quantize: str | None = None,
                group_size: int = INT4_GROUP, device_type: str = "cpu") -> dict:
    """Every rank's tensors as `autotp plan` prints them; device_type: whose quantized kernels must take
    each slice (an int4 slice CUDA's kernel cannot run is refused as it would be when loading there)."""
    model_dir = resolve_model_dir(model, patterns=["config.json"])
    p = prepare(tp, device_type, model_dir=model_dir, dtype=dtype, quantize=quantize, group_size=group_size,
                checkpoint=False, buffers=False)
    layout, plan = p.layout, p.plan
    ranks = []
    for rank, h in enumerate(layout.heads):
        tensors = [{"name": t.name, "tied": list(t.aliases), "shape": list(t.shape),
                    "holds": t.shards[rank].describe(len(t.shape)), "local_shape": list(t.local_shape(rank)),
                    "bytes": t.nbytes(rank),
                    "stored": t.quant.quant.kind if t.quant else str(t.dtype).removeprefix("torch.")}
                   for t in layout.params.values()]
        ranks.append({"rank": rank, "q_heads": [h.q_start, h.q_stop], "kv_heads": [h.kv_start, h.kv_stop],
                      "total_bytes": layout.rank_bytes(rank), "tensors": tensors})
    return {"model": str(model), "family": plan.family, "plan_source": plan.source, "tp": tp,
            "dtype": str(p.dtype).removeprefix("torch."), "checkpoint_headers": p.checkpoint is not None,
            "quantize": quantize, "group_size": group_size if quantize == "int4" else None,
            "device": device_type, "num_heads": plan.num_heads, "num_kv_heads": plan.num_kv_heads, "ranks": ranks}


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

