"""`autotp plan --devices`: tp, pp, the layer split and the weight form chosen from the memory each GPU has.

Pure arithmetic over byte counts; the counts themselves come from `autotp plan` (report.plan_report, imported only
by `measure`), so that the fit and the plan it prints agree byte for byte. The rules:
- tensor parallelism inside a host whose devices are alike (its shards are equal, so a stage is bounded by its
  smallest device): a host of n alike GPUs is one stage of tp n; a host whose GPUs differ is a stage per GPU (24 + 12
  GiB hold more as two stages than as tp 2); stages never span hosts, and every stage runs at one tp (the engine's
  world is pp x tp), so hosts of 2 and 1 GPUs run a stage per GPU;
- layers per stage in proportion to what each stage holds after its fixed costs (the input embedding on the first
  stage, the LM head on the last, both where the plan puts them, a tied embedding on each; the KV cache of
  `kv_tokens` tokens for each of its layers), largest remainders first, then repaired so that each stage fits;
- where the user gave no --dtype/--quantize, the most precise weight form that fits: as stored, then int8, then int4.
What the user gave (tp, pp, the layer split, the form) is kept and only checked. Every device keeps MARGIN free.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from autotp.errors import AutotpError

GiB = 2**30
# Kept free on every device: the CUDA context with torch's kernels loaded (~0.5 GiB), cuBLAS's workspace and the
# activations of a prefill chunk. The weights and the KV reserve get the rest.
MARGIN = GiB
KV_TOKENS = 2048  # the KV reserve of a model whose config states no context (BLOOM's ALiBi): --kv-tokens sets it
FORMS = ((None, None), (None, "int8"), (None, "int4"))  # (dtype, quantize), most precise first: as stored first


@dataclasses.dataclass(frozen=True)
class Costs:
    """One weight form at one tp, from `autotp plan`: bytes each tensor-parallel rank r holds.
    layers[r][i]: decoder layer i's tensors; first[r] / last[r]: what only a pipeline's first / last stage holds
    (input embedding, learned positions / LM head); every[r]: what every stage holds (final norm); whole[r]: the
    rank's bytes with no pipeline (a tied embedding counted once); kv[r]: one token's keys and values in one layer."""

    dtype: str
    quantize: str | None
    tp: int
    layers: tuple[tuple[int, ...], ...]
    first: tuple[int, ...]
    last: tuple[int, ...]
    every: tuple[int, ...]
    whole: tuple[int, ...]
    kv: tuple[int, ...]

    def weights(self, r: int, span: range, pp: int, stage: int) -> int:
        if pp == 1:
            return self.whole[r]
        return (self.every[r] + (self.first[r] if stage == 0 else 0) + (self.last[r] if stage == pp - 1 else 0)
                + sum(self.layers[r][i] for i in span))


@dataclasses.dataclass(frozen=True)
class Stage:
    host: int
    devices: tuple[int, ...]  # local GPU indices on the host, one per tensor-parallel rank
    layers: range
    weights: tuple[int, ...]  # bytes per rank
    kv: tuple[int, ...]  # the KV reserve's bytes per rank
    budget: tuple[int, ...]  # device bytes less MARGIN, per rank


@dataclasses.dataclass(frozen=True)
class Fit:
    tp: int
    pp: int
    dtype: str
    quantize: str | None
    kv_tokens: int
    stages: tuple[Stage, ...]
    note: str = ""

    @property
    def pp_layers(self) -> tuple[int, ...]:
        return tuple(len(s.layers) for s in self.stages)

    def lines(self) -> list[str]:
        form = self.dtype + (f", linear weights {self.quantize}" if self.quantize else "")
        note = f"; {self.note}" if self.note else ""
        head = [f"tp={self.tp} pp={self.pp} layers {','.join(map(str, self.pp_layers))}, {form}; KV reserve "
                f"{self.kv_tokens} tokens, {gib(MARGIN)} GiB kept free per device{note}"]
        return head + [stage_line(i, s, self.quantize or self.dtype) for i, s in enumerate(self.stages)]

    def as_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "pp_layers": list(self.pp_layers), "dtype": self.dtype,
                "quantize": self.quantize, "kv_tokens": self.kv_tokens, "margin_bytes": MARGIN, "note": self.note,
                "stages": [{"stage": i, "host": s.host, "devices": list(s.devices), "layers": [s.layers.start,
                            s.layers.stop], "weight_bytes": list(s.weights), "kv_bytes": list(s.kv),
                            "budget_bytes": list(s.budget),
                            "headroom_bytes": [b - w - k for w, k, b in zip(s.weights, s.kv, s.budget, strict=True)]}
                           for i, s in enumerate(self.stages)]}


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def stage_line(i: int, s: Stage, form: str) -> str:
    """`stage 2 on host 1 (cuda:0): layers 33-39, 5.51 GiB + 0.03 GiB KV of 7.00 GiB, bfloat16`, for its fullest
    rank; form: the linear weights' (int8, int4) or the dtype."""
    r = max(range(len(s.weights)), key=lambda r: s.weights[r] + s.kv[r] - s.budget[r])
    devices = ",".join(f"cuda:{d}" for d in s.devices)
    return (f"stage {i} on host {s.host} ({devices}): layers {s.layers.start}-{s.layers.stop - 1}, "
            f"{gib(s.weights[r])} GiB + {gib(s.kv[r])} GiB KV of {gib(s.budget[r])} GiB, {form}")


def layouts(hosts: list[list[int]], tp: int | None) -> list[tuple[int, list[tuple[int, tuple[int, ...]]]]]:
    """Candidate (tp, stages as (host, local devices)), preferred first: the largest tp whose stages stay inside one
    host on alike devices (or the user's tp, alike or not: bounded by its smallest device), down to a stage per GPU."""
    counts = [len(h) for h in hosts]
    if tp is not None:
        if any(n % tp for n in counts):
            raise AutotpError(f"--tp {tp} does not divide the hosts' GPUs ({' and '.join(map(str, counts))}): a "
                              "stage's ranks stay on one host and every stage runs at one tp (world = pp x tp); "
                              f"--tp 1 --pp {sum(counts)} (a stage per GPU) is the layout these hosts allow")
        candidates = [tp]
    else:
        candidates = [t for t in range(max(counts), 0, -1)
                      if all(n % t == 0 and all(len(set(h[i:i + t])) == 1 for i in range(0, n, t))
                             for n, h in zip(counts, hosts, strict=True))]
    return [(t, [(k, tuple(range(i, i + t))) for k, h in enumerate(hosts) for i in range(0, len(h), t)])
            for t in candidates]


def split(num_layers: int, rooms: list[float], fits: Callable[[list[int]], int | None]) -> list[int] | None:
    """Layers per stage in proportion to `rooms` (what each stage holds, in layers), largest remainders first, each
    stage at least one; then, while `fits(counts)` names a stage that does not fit, one of its layers moves to the
    stage with the most room left. None where no split fits."""
    pp = len(rooms)
    if num_layers < pp or min(rooms) < 1:
        return None
    quotas = [num_layers * r / sum(rooms) for r in rooms]
    counts = [max(1, int(q)) for q in quotas]
    by_remainder = sorted(range(pp), key=lambda s: quotas[s] - int(quotas[s]), reverse=True)
    for s in by_remainder[:max(0, num_layers - sum(counts))]:
        counts[s] += 1
    while sum(counts) > num_layers:  # stages raised to one layer: the fullest gives one back
        counts[max(range(pp), key=lambda s: counts[s] - rooms[s])] -= 1
    for _ in range(num_layers * pp):
        over = fits(counts)
        if over is None:
            return counts
        spare = [s for s in range(pp) if s != over and counts[s] < int(rooms[s])]
        if counts[over] == 1 or not spare:
            return None
        counts[over] -= 1
        counts[max(spare, key=lambda s: rooms[s] - counts[s])] += 1
    return None


def place(costs: Costs, num_layers: int, stages: list[tuple[int, tuple[int, ...]]], hosts: list[list[int]],
          kv_tokens: int, pp_layers: tuple[int, ...] | None) -> tuple[tuple[Stage, ...], str]:
    """The stages of one layout and form, split as given or by `split`; ((), why) where they do not fit."""
    pp = len(stages)
    budget = [tuple(hosts[h][d] - MARGIN for d in devs) for h, devs in stages]
    kv = [costs.kv[r] * kv_tokens for r in range(costs.tp)]

    def built(counts) -> list[Stage]:
        starts = [sum(counts[:s]) for s in range(pp)]
        spans = [range(a, a + n) for a, n in zip(starts, counts, strict=True)]
        return [Stage(h, devs, span, tuple(costs.weights(r, span, pp, s) for r in range(costs.tp)),
                      tuple(k * len(span) for k in kv), budget[s])
                for s, ((h, devs), span) in enumerate(zip(stages, spans, strict=True))]

    def over(counts) -> int | None:
        return next((i for i, s in enumerate(built(counts))
                     if any(w + k > b for w, k, b in zip(s.weights, s.kv, s.budget, strict=True))), None)

    if pp_layers is None and pp > 1:
        mean = [(sum(costs.layers[r]) / num_layers + kv[r]) for r in range(costs.tp)]
        fixed = [[costs.weights(r, range(0), pp, s) for r in range(costs.tp)] for s in range(pp)]
        rooms = [min((budget[s][r] - fixed[s][r]) / mean[r] for r in range(costs.tp)) for s in range(pp)]
        counts = split(num_layers, rooms, over)
        if counts is None:
            worst = min(range(pp), key=lambda s: rooms[s])
            return (), f"stage {worst} holds {max(rooms[worst], 0):.1f} layers after its fixed costs"
    else:
        counts = list(pp_layers or [num_layers])
        if over(counts) is not None:
            s = built(counts)[over(counts)]
            return (), stage_line(over(counts), s, costs.quantize or costs.dtype) + " does not fit"
    return tuple(built(counts)), ""


def fit(hosts: list[list[int]], num_layers: int, measure: Callable[[str | None, str | None, int, int], Costs],
        kv_tokens: int, tp: int | None = None, pp: int | None = None, pp_layers: tuple[int, ...] | None = None,
        dtype: str | None = None, quantize: str | None = None) -> Fit:
    """The first layout and form that fits (module docstring); measure(dtype, quantize, tp, pp) gives a form's Costs
    at a tp. Raises an AutotpError with the nothing-fits line."""
    if pp_layers is not None:
        pp = len(pp_layers)
    candidates = [(t, st) for t, st in layouts(hosts, tp) if pp is None or len(st) == pp]
    if not candidates:
        raise AutotpError(f"--pp {pp} does not match the devices: {sum(map(len, hosts))} GPUs on {len(hosts)} "
                          f"host(s) make {', '.join(str(len(st)) for _, st in layouts(hosts, tp))} stages")
    forms = [(dtype, quantize)] if dtype or quantize else list(FORMS)
    counts = [len(h) for h in hosts]
    note = (f"a stage per GPU: hosts of {' and '.join(map(str, counts))} GPUs, and every stage runs at one tp"
            if tp is None and len(set(counts)) > 1 and candidates[0][0] == 1 and max(counts) > 1
            and all(len(set(h)) == 1 for h in hosts) else "")
    tried = []
    for d, q in forms:
        for t, stages in candidates:
            costs = measure(d, q, t, len(stages))
            placed, why = place(costs, num_layers, stages, hosts, kv_tokens, pp_layers)
            if placed:
                return Fit(t, len(stages), costs.dtype, costs.quantize, kv_tokens, placed, note)
            tried.append((costs, stages, why))
    raise AutotpError(nothing_fits(tried[0], hosts, num_layers, measure, kv_tokens, candidates, pp_layers,
                                   fixed=bool(dtype or quantize)))


def nothing_fits(first, hosts, num_layers, measure, kv_tokens, candidates, pp_layers, fixed: bool) -> str:
    """`needs 28.90 GiB of weights + 0.16 GiB KV; the 3 devices hold 26.00 GiB (less 1.00 GiB each): int8 fits
    (--quantize int8) with 10.40 GiB for the cache`, for the preferred layout of the most precise form asked."""
    costs, stages, why = first
    pp = len(stages)
    weights = sum(costs.whole) if pp == 1 else sum(
        pp * costs.every[r] + costs.first[r] + costs.last[r] + sum(costs.layers[r]) for r in range(costs.tp))
    kv = sum(costs.kv) * kv_tokens * num_layers
    room = sum(b - MARGIN for h in hosts for b in h)
    form = costs.dtype + (f" with {costs.quantize} linear weights" if costs.quantize else "")
    line = (f"{form} needs {gib(weights)} GiB of weights + {gib(kv)} GiB KV ({kv_tokens} tokens) at tp {costs.tp} "
            f"pp {pp}; the {sum(map(len, hosts))} devices hold {gib(room)} GiB ({gib(MARGIN)} GiB kept free on each)")
    if weights + kv <= room:
        line += f", but {why}"
    for d, q in FORMS:
        if (d, q) == (None, costs.quantize) and not fixed:
            continue
        for t, st in candidates:
            other = measure(d, q, t, len(st))
            placed, _ = place(other, num_layers, st, hosts, kv_tokens, pp_layers)
            if placed and (other.dtype, other.quantize) != (costs.dtype, costs.quantize):
                free = sum(b - w for s in placed for w, b in zip(s.weights, s.budget, strict=True))
                flag = f"--quantize {q}" if q else f"--dtype {other.dtype}"
                return line + f": {q or other.dtype} fits ({flag} --tp {t}) with {gib(free)} GiB for the KV cache"
    return line + ": no weight form fits (int4 is the smallest)"


def commands(chosen: Fit, model: str, gpus: list[int], dtype: str | None, group_size: int) -> list[str]:
    """The command line that starts `chosen`: `autotp serve --tp T` on one host (it starts its ranks), else torchrun on
    each host, host 0 first (ranks are numbered host by host, so stage s lands where the fit put it)."""
    serve = f"-m autotp serve --model {model} --tp {chosen.tp}"
    if chosen.pp > 1:
        serve += f" --pp {chosen.pp} --pp-layers {','.join(map(str, chosen.pp_layers))}"
    serve += (f" --dtype {dtype}" if dtype else "") + (f" --quantize {chosen.quantize}" if chosen.quantize else "")
    serve += f" --group-size {group_size}" if chosen.quantize == "int4" and group_size != 128 else ""
    if len(gpus) == 1:
        return ["autotp" + serve.removeprefix("-m autotp")]
    return [f"host {h}: torchrun --nnodes {len(gpus)} --node-rank {h} --nproc-per-node {n} --master-addr HOST0_ADDRESS "
            f"--master-port 29500 {serve}" for h, n in enumerate(gpus)]


def parse_context(fields: dict) -> int | None:
    """The config's position limit (context.POSITION_LIMITS), from config.json's fields."""
    from autotp.context import POSITION_LIMITS

    return next((fields[f] for f in POSITION_LIMITS if isinstance(fields.get(f), int) and fields[f] > 0), None)


def measure(model: str, group_size: int, device_type: str) -> Callable[[str | None, str | None, int, int], Costs]:
    """Costs from `autotp plan` itself: per (form, tp), one report with two stages (layer 0 | the rest) gives what
    the first stage alone holds, what the last alone holds, what both hold and each layer's bytes; one without a
    pipeline gives the whole (a tied embedding once). Cached: the fit asks again for the same form and tp."""
    from autotp.report import plan_report

    cache: dict = {}

    def costs(dtype, quantize, tp, pp) -> Costs:
        key = (dtype, quantize, tp, pp == 1)
        if key in cache:
            return cache[key]
        whole = plan_report(model, tp, dtype, quantize, group_size, device_type)
        num_layers = whole["ranks"][0]["layers"][1]
        layer_of = re.compile(rf"{re.escape(whole['layers_path'])}\.(\d+)\.")
        kv = tuple(r["kv_bytes_per_token"] // num_layers for r in whole["ranks"])
        layers = [[0] * num_layers for _ in range(tp)]
        nonlayer = [[{} for _ in range(tp)], [{} for _ in range(tp)]]
        if pp > 1 and num_layers > 1:
            report = plan_report(model, tp, dtype, quantize, group_size, device_type, pp=2,
                                 pp_layers=(1, num_layers - 1))
            for entry in report["ranks"]:
                r = entry["rank"] % tp
                for t in entry["tensors"]:
                    found = layer_of.match(t["name"])
                    if found:
                        layers[r][int(found.group(1))] += t["bytes"]
                    else:
                        nonlayer[entry["stage"]][r][t["name"]] = t["bytes"]
        every = tuple(sum(b for n, b in nonlayer[0][r].items() if n in nonlayer[1][r]) for r in range(tp))
        first = tuple(sum(nonlayer[0][r].values()) - every[r] for r in range(tp))
        last = tuple(sum(nonlayer[1][r].values()) - every[r] for r in range(tp))
        cache[key] = Costs(whole["dtype"], quantize, tp, tuple(map(tuple, layers)), first, last, every,
                           tuple(r["total_bytes"] for r in whole["ranks"]), kv)
        return cache[key]

    return costs
