"""The model card (README.md of the model directory), from metrics.json: phase 1 alone, or phase 1 followed by
continued training.

The prose lives in model_card.md.tmpl; this module only works out the figures that fill it (sizes in MB,
totals over the phases, the held-out table) and picks the sections that apply.
"""

from __future__ import annotations

import re
from pathlib import Path

TEMPLATE = Path(__file__).resolve().with_name("model_card.md.tmpl")
ROWS = [  # held-out table: row name, loss key, perplexity key
    ("plain left-to-right", "plain_loss", "plain_ppl"),
    ("fill-in-the-middle (every segment PSM), all tokens", "fim_loss", "fim_ppl"),
    ("fill-in-the-middle, middle tokens only", "fim_middle_loss", "fim_middle_ppl"),
]


def sections() -> dict[str, str]:
    """The template's `<!-- section: NAME -->` blocks, without their leading and trailing blank lines."""
    parts = re.split(r"^<!-- section: (\w+) -->$", TEMPLATE.read_text(), flags=re.M)
    return {name: body.strip("\n") for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def model_card(s: dict) -> str:
    """README.md of the model directory, from metrics.json."""
    t = sections()
    phases = [*s.get("previous_phases", []), s]
    ex = s["examples"]
    figures = {
        **{k: v for k, v in s.items() if not isinstance(v, dict | list)},
        "n_inner": 4 * s["n_embd"],
        "head_dim": s["n_embd"] // s["n_head"],
        "size_mb": s["safetensors_bytes"] / 1e6,
        "train_mb": s["train_bytes"] / 1e6,
        "heldout_mb": s["heldout_bytes"] / 1e6,
        "train_mtokens": s["train_corpus_tokens"] / 1e6,
        "total_epochs": s.get("all_phases_epochs", s["epochs"]),
        "training": training(t, s, phases),
        "table": table(s, phases),
        "quantized": quantized(t, s),
        "reproduce": reproduce(t, s, phases),
        "curves": "`demo/loss_curve.csv`" + (" and `demo/loss_curve_continued.csv`" if len(phases) > 1 else ""),
        "fim_vs_plain": "worse than" if s["heldout_fim_middle_loss"] > s["heldout_plain_loss"] else "better than",
        **ex,
        **{f"{k}_esc": _esc(ex[k]) for k in ("fim_prefix", "fim_suffix", "fim_middle")},
    }
    return t["card"].format_map(figures) + "\n"


def training(t: dict[str, str], s: dict, phases: list[dict]) -> str:
    """The "Training" section: the shared objective, one paragraph per phase, the totals."""
    a1, one = phases[0]["args"], len(phases) == 1
    paragraphs = [
        t["objective"].format(
            **a1,
            short_fraction=1 - float(a1["long_fraction"]),
            within_each_phase="" if one else "within each phase, ",
            each_phases="The" if one else "Each phase's",
            whose="the" if one else "that phase's",
        )
    ]
    for n, ph in enumerate(phases, 1):
        what = t["phase_1_what"] if n == 1 else t["continued_what"].format(previous=n - 1, **ph)
        figures = ph["args"] | phase_figures(ph) | {"min_lr_ratio": float(ph["args"]["min_lr_ratio"])}
        text = t["phase"].format(n=n, what=what, **figures)
        if n > 1:
            text += "\n" + t["continued_change"].format(**ph)
        paragraphs.append(text)
    keys = ("steps", "tokens_seen", "train_seconds", "epochs")
    total = phase_figures({k: s.get(f"all_phases_{k}", s[k]) for k in keys})
    niced = " (phase 2 ran at `nice -n 19`, on CPU time they left idle)" if not one else ""
    paragraphs.append(t["total"].format(**s | total, niced=niced))
    return "\n\n".join(paragraphs)


def phase_figures(ph: dict) -> dict:
    """A phase's (or the total's) counts, with its minutes and throughput."""
    out = dict(ph, train_minutes=ph["train_seconds"] / 60, tokens_per_second=ph["tokens_seen"] / ph["train_seconds"])
    if "total_seconds" in ph:
        out["total_minutes"] = ph["total_seconds"] / 60
    return out


def table(s: dict, phases: list[dict]) -> str:
    """Held-out loss and perplexity: one column pair, or one per phase."""
    if len(phases) == 1:
        head = "| | loss (nats/token) | perplexity |\n|---|---|---|"
        lines = [f"| {name} | {s[f'heldout_{lo}']:.3f} | {s[f'heldout_{pp}']:.1f} |" for name, lo, pp in ROWS]
        return "\n".join([head, *lines])
    cols = " | ".join(f"after phase {n}: loss | ppl" for n in range(1, len(phases) + 1))
    head = f"| | {cols} |\n|---|" + "---|---|" * len(phases)
    lines = []
    for name, lo, pp in ROWS:
        cells = " | ".join(f"{ph[f'heldout_{lo}']:.3f} | {ph[f'heldout_{pp}']:.1f}" for ph in phases)
        lines.append(f"| {name} | {cells} |")
    return "\n".join([head, *lines])


def quantized(t: dict[str, str], s: dict) -> str:
    """The quantized-weights section (after the held-out results), when metrics.json has its figures
    (benchmarks/quant_quality.py --update-metrics); else nothing."""
    q = s.get("quantized")
    if not q:
        return ""
    lines = ["| weights | weights MB | held-out loss | vs fp32 | FIM loss | vs fp32 | prefix agreement "
             "| position-wise agreement | identical continuations |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in q["rows"].items():
        lines.append(
            f"| {name} | {r['weight_bytes'] / 1e6:.1f} | {r['heldout_plain_loss']:.4f} | {r['plain_loss_change']:+.2%} "
            f"| {r['heldout_fim_loss']:.4f} | {r['fim_loss_change']:+.2%} | {r['prefix_agreement']:.1%} "
            f"| {r['positionwise_agreement']:.1%} | {r['identical_prompts']} of {q['prompts']} |"
        )
    return "\n\n" + t["quantized"].format(**q, quant_table="\n".join(lines))


def reproduce(t: dict[str, str], s: dict, phases: list[dict]) -> str:
    p1 = phases[0]
    if len(phases) == 1:
        return t["reproduce_one_phase"].format(**p1, budget_minutes=p1["args"]["budget_minutes"])
    return t["reproduce_two_phases"].format(
        **s,
        phase_1_command=p1["command"].strip(),
        phase_1_seed=p1["seed"],
        budget_minutes=p1["args"]["budget_minutes"],
    )


def _esc(text: str) -> str:
    return text.encode("unicode_escape").decode()
