"""`autotp plan`: how every tensor of a model is partitioned across ranks, from config.json alone.

Prepares the model as loading would (`autotp.prepare`: a meta skeleton, no weights, no processes) and
reports, for every rank, each tensor's global shape, the slice or replication the rank holds, and its
bytes. When the directory also has safetensors files, their headers give the stored dtype and are
checked against the config, still without reading a weight. For a GPTQ checkpoint (its config's
quantization_config) each quantized weight also lists the GPTQ tensors the rank reads for it, their slices
and bytes (from the config alone: as GPTQ writers store every linear layer of the blocks).
"""

from __future__ import annotations

import re

from autotp.hub import resolve_model_dir
from autotp.parallel.stage_cut import cut, decoder_layers, layers_path
from autotp.parallel.stages import Stages
from autotp.prepare import prepare
from autotp.quant.weights import INT4_GROUP


def plan_report(model: str, tp: int, dtype: str | None = None, quantize: str | None = None,
                group_size: int = INT4_GROUP, device_type: str = "cpu", pp: int = 1,
                pp_layers: tuple[int, ...] | None = None) -> dict:
    """Every rank's tensors as `autotp plan` prints them; device_type: whose quantized kernels must take
    each slice (an int4 slice CUDA's kernel cannot run is refused as it would be when loading there). pp: pipeline
    stages of tp ranks each (rank = stage * tp + its rank in the stage), layers split as pp_layers says or evenly:
    each rank's layers and the bytes one cached token costs it (its layers' keys and values, its KV heads)."""
    model_dir = resolve_model_dir(model, patterns=["config.json"])

    def prepared():
        return prepare(tp, device_type, model_dir=model_dir, dtype=dtype, quantize=quantize, group_size=group_size,
                       checkpoint=False, buffers=False)

    p = prepared()
    plan = p.plan
    num_layers = len(decoder_layers(p.model, plan))
    stages = Stages.split(pp, tp, num_layers, pp_layers) if pp > 1 else None
    ranks = []
    for stage in range(pp):
        q = p if stages is None else prepared()
        layout = q.layout if stages is None else cut(q.model, q.layout, stages, stage)
        span = range(num_layers) if stages is None else stages.span(stage)
        names = {n for n, _ in q.model.named_parameters(remove_duplicate=False)}  # the stage's (a tied head's)
        for tp_rank, h in enumerate(layout.heads):
            ranks.append(_rank_entry(layout, tp_rank, h, stage * tp + tp_rank, names) | {
                "stage": stage, "layers": [span.start, span.stop],
                "kv_bytes_per_token": 2 * len(span) * (h.kv_stop - h.kv_start) * plan.head_dim * p.dtype.itemsize})
    gptq = None if p.gptq is None else {"group_size": p.gptq.group_size, "version": p.gptq.version, "sym": p.gptq.sym}
    return {"model": str(model), "family": plan.family, "plan_source": plan.source, "tp": tp, "pp": pp,
            "layers_path": layers_path(plan),
            "dtype": _dtype_name(p.dtype), "checkpoint_headers": p.checkpoint is not None,
            "quantize": quantize, "group_size": group_size if quantize == "int4" else None, "gptq": gptq,
            "device": device_type, "num_heads": plan.num_heads, "num_kv_heads": plan.num_kv_heads, "ranks": ranks}


def _rank_entry(layout, tp_rank: int, h, rank: int, present: set[str]) -> dict:
    """One rank's tensors (its slice of each, as its rank in the stage holds it) and their bytes, each by the names
    its module has there (`present`: on a pipeline's last stage a tied embedding is the LM head's weight alone)."""
    tensors = []
    for t in layout.params.values():
        name, *tied = [n for n in (t.name, *t.aliases) if n in present]
        tensor = {"name": name, "tied": tied, "shape": list(t.shape),
                  "holds": t.shards[tp_rank].describe(len(t.shape)), "local_shape": list(t.local_shape(tp_rank)),
                  "bytes": t.nbytes(tp_rank),
                  "stored": t.quant.quant.kind if t.quant else str(t.dtype).removeprefix("torch.")}
        if t.gptq:  # what the rank reads instead of the weight
            tensor["gptq"] = [{"name": r.key, "shape": list(r.shape), "holds": r.shard.describe(len(r.shape)),
                               "local_shape": list(r.shard.local_shape(r.shape)), "bytes": r.nbytes(),
                               "stored": _dtype_name(r.dtype)} for r in t.gptq[tp_rank].reads]
        tensors.append(tensor)
    gptq_bytes = sum(r["bytes"] for t in tensors for r in t.get("gptq", ()))
    return {"rank": rank, "q_heads": [h.q_start, h.q_stop], "kv_heads": [h.kv_start, h.kv_stop],
            "total_bytes": layout.rank_bytes(tp_rank), "gptq_read_bytes": gptq_bytes, "tensors": tensors}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_report(report: dict) -> str:
    """Text table per rank; identical tensors of different layers fold into one `h.*` row with a count."""
    pp = report.get("pp", 1)
    lines = [f"{report['model']}: {report['family']} ({report['plan_source']} plan), tp={report['tp']}, "
             + (f"pp={pp}, " if pp > 1 else "")
             + f"dtype={report['dtype']}, {report['num_heads']} query heads / {report['num_kv_heads']} KV heads"
             + (f", linear weights {report['quantize']}" if report["quantize"] else "")
             + (f" (groups of {report['group_size']})" if report["group_size"] else "")
             + (f", GPTQ 4-bit checkpoint (groups of {report['gptq']['group_size']}, v{report['gptq']['version']}) "
                "repacked to int4" if report.get("gptq") else "")
             + ("" if report["checkpoint_headers"] else " [config only: no checkpoint headers read]")]
    for r in report["ranks"]:
        reads = f", reads {_human(r['gptq_read_bytes'])} of GPTQ tensors" if r.get("gptq_read_bytes") else ""
        stage = f" (stage {r['stage']}, layers {r['layers'][0]}-{r['layers'][1] - 1})" if pp > 1 else ""
        lines.append(f"\nrank {r['rank']}{stage}: query heads {r['q_heads'][0]}:{r['q_heads'][1]}, "
                     f"KV heads {r['kv_heads'][0]}:{r['kv_heads'][1]}, {_human(r['total_bytes'])}{reads}, KV cache "
                     f"{_human(r['kv_bytes_per_token'])} per token")
        folded: dict[tuple, list] = {}
        for t in r["tensors"]:
            sources = tuple((_fold(g["name"]), tuple(g["shape"]), g["holds"], tuple(g["local_shape"]), g["stored"])
                            for g in t.get("gptq", ()))
            key = (_fold(t["name"]), tuple(t["shape"]), t["holds"], tuple(t["local_shape"]), t["stored"], sources)
            folded.setdefault(key, []).append(t)
        width = max(len(k[0]) for k in folded) + 6
        for (name, shape, holds, local, stored, sources), ts in folded.items():
            count = f" x{len(ts)}" if len(ts) > 1 else ""
            tied = f" (tied: {', '.join(ts[0]['tied'])})" if ts[0]["tied"] else ""
            lines.append(_row(name + count, width, shape, holds, local, stored, sum(t["bytes"] for t in ts)) + tied)
            for i, (source, s_shape, s_holds, s_local, s_stored) in enumerate(sources):  # what the rank reads for it
                read = sum(t["gptq"][i]["bytes"] for t in ts)
                lines.append(_row("  reads " + source.rpartition(".")[2], width, s_shape, s_holds, s_local, s_stored,
                                  read))
    return "\n".join(lines)


def _fold(name: str) -> str:
    """Layers' tensors under one name: transformer.h.3.attn -> transformer.h.*.attn."""
    return re.sub(r"\.\d+\.", ".*.", name)


def _row(name: str, width: int, shape, holds: str, local, stored: str, nbytes: int) -> str:
    return (f"  {name:<{width}} {str(list(shape)):>16}  {holds:<36} {str(list(local)):>16}  {stored:>8}  "
            f"{_human(nbytes):>10}")

