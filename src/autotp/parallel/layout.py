"""The resolved layout: a plan applied to one model at one tp size, worked out once and validated once.

Plan, then apply (torchtitan's order), with the per-tensor step in the middle made explicit:

    plan (data, per family) + model tree + tp [+ checkpoint headers]  --resolve-->  Layout
    Layout + rank + a function that produces each tensor               --shard.parallelize-->  rank's model

A `Layout` holds each rank's heads, the module swaps (path -> style, the same paths on every rank) and,
for every parameter, its names (tied weights have several), the checkpoint key that holds it, its global
shape and dtype, the `TensorShard` each rank holds and, for a quantized linear weight, how it is
quantized (for a GPTQ checkpoint: the part of each GPTQ tensor every rank reads, `quant.gptq.GptqSlice`).
Everything that can be wrong is found here, before a weight is read: heads vs tp, plan patterns that
match no module, empty slices, tied weights split two ways, int4 groups a rank would split, and with a
checkpoint its missing, unused, mis-shaped and mis-typed tensors (GPTQ ones included). The loader, the
in-place path of `init_inference` and `autotp plan` all read the same object. Nothing here reads a
weight or talks to another rank; the model may be a meta skeleton.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from autotp.errors import AutotpError
from autotp.loading.checkpoint import DTYPE_NAMES, Checkpoint, Piece
from autotp.parallel.partition import HeadShard
from autotp.parallel.slices import REPLICATED, TensorShard
from autotp.parallel.styles import Geometry, RankContext, Rowwise, Style
from autotp.plans import Plan
from autotp.quant.gptq import GptqFormat, GptqKeys, GptqSlice
from autotp.quant.load import QuantTarget
from autotp.quant.weights import INT4_GROUPS, Quant, kernel_fits


@dataclass(frozen=True)
class ExpertKeys:
    """A fused experts tensor (experts, rows, cols) stored the hub's way: keys[e][p] holds rows
    p*h:(p+1)*h of expert e's matrix, (h, cols) with h = rows / parts (plans.plan.FusedSource)."""

    shape: tuple[int, ...]  # the fused tensor's, global
    keys: tuple[tuple[str, ...], ...]  # [expert][part]

    def part_shape(self) -> tuple[int, int]:
        return self.shape[1] // len(self.keys[0]), self.shape[2]

    def reads(self, shard: TensorShard) -> list[Piece]:
        """`shard` of the fused tensor as reads of the parts, for `Checkpoint.assemble`: (key, shard of that part,
        the rank's expert index, its first row in that expert's local matrix). A row slice (dim 1, e.g. gate
        rows a:b and up rows I+a:I+b) reads rows of the parts it spans, a column slice (dim 2) the same
        columns of every part, an expert slice (dim 0) only those experts' parts, whole."""
        rows, h = self.shape[1], self.part_shape()[0]
        experts = [e for a, b in shard.ranges for e in range(a, b)] if shard.dim == 0 else range(self.shape[0])
        spans = shard.ranges if shard.dim == 1 else ((0, rows),)
        out = []
        for local, e in enumerate(experts):
            row = 0
            for a, b in spans:
                for p in range(a // h, (b - 1) // h + 1):
                    a_p, b_p = max(a, p * h) - p * h, min(b, (p + 1) * h) - p * h
                    part = (TensorShard.along(0, [(a_p, b_p)]) if shard.dim == 1
                            else TensorShard.along(1, list(shard.ranges)) if shard.dim == 2 else REPLICATED)
                    out.append(Piece(self.keys[e][p], part, local, row))
                    row += b_p - a_p
        return out


@dataclass(frozen=True)
class Param:
    """One parameter of the model, as every rank will hold it."""

    name: str  # its first name, in registration order
    aliases: tuple[str, ...]  # its other names (weights tied to it)
    # the checkpoint tensor it is read from (or a fused experts tensor's per-expert tensors, or a GPTQ layer's
    # tensors); None when no checkpoint was given
    key: str | ExpertKeys | GptqKeys | None
    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    shards: tuple[TensorShard, ...]  # [rank] -> the part that rank holds
    quant: QuantTarget | None = None  # a linear weight stored quantized
    gptq: tuple[GptqSlice, ...] = ()  # [rank] -> what it reads of the GPTQ tensors standing for this weight

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.shards[rank].local_shape(self.shape)

    def nbytes(self, rank: int) -> int:
        """Bytes on the rank: its slice in the model dtype, or quantized with its scales."""
        local = self.local_shape(rank)
        if self.quant is None:
            return math.prod(local) * self.dtype.itemsize
        out_features, in_features = (local[1], local[0]) if self.quant.conv1d else local
        return self.quant.quant.nbytes(out_features, in_features, self.dtype)


@dataclass(frozen=True)
class Layout:
    plan: Plan
    tp: int
    heads: tuple[HeadShard, ...]  # [rank]
    swaps: tuple[tuple[str, Style], ...]  # (module path, style) of every module the plan replaces, in model order
    params: dict[str, Param]  # first name -> Param, in registration order

    def param(self, name: str) -> Param:
        """The Param reachable by `name`, its first name or an alias."""
        return self.params[self._first[name]]

    @cached_property
    def _first(self) -> dict[str, str]:
        return {n: p.name for p in self.params.values() for n in (p.name, *p.aliases)}

    def rank_bytes(self, rank: int) -> int:
        return sum(p.nbytes(rank) for p in self.params.values())


def parameter_names(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name -> all its names (tied weights have several), in registration order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def resolve(model: nn.Module, plan: Plan, tp: int, checkpoint: Checkpoint | None = None,
            quant: Quant | None = None, dtype: torch.dtype | None = None, device_type: str = "cpu",
            gptq: GptqFormat | None = None) -> Layout:
    """The layout of `model` under `plan` at `tp` ranks, its linear weights quantized as `quant` says (or
    stored GPTQ-quantized in `gptq`'s format: with a checkpoint, the layers it stores so; without, every
    layer a style can run quantized) and its floating parameters held in `dtype` (None: as the model has
    them); raises AutotpError on anything that cannot load."""
    heads = tuple(plan.heads(tp))
    swaps = _swaps(model, plan)
    names = parameter_names(model)
    per_rank = [_rank_shards(model, plan, swaps, names, RankContext(rank, tp, heads[rank])) for rank in range(tp)]
    # GPTQ: the weights of the styles that run quantized; those the checkpoint stores so (all, without one)
    runnable = _quant_targets(model, swaps, gptq.quant, gptq=True) if gptq is not None else None
    keys = _checkpoint_keys(checkpoint, model, plan, names, runnable) if checkpoint is not None else {}
    targets = _quant_targets(model, swaps, quant) if quant is not None else {}
    if runnable is not None:
        targets = {n: t for n, t in runnable.items() if checkpoint is None or isinstance(keys.get(n), GptqKeys)}
    params = {}
    for first, all_names in names.items():
        meta = model.get_parameter(first)
        held = dtype if dtype is not None and meta.is_floating_point() else meta.dtype
        param = Param(first, tuple(all_names[1:]), keys.get(first), tuple(meta.shape), held,
                      tuple(shards[first] for shards in per_rank), targets.get(first))
        if param.quant is not None:
            _check_quantizable(param, tp, device_type)
        if param.quant is not None and param.quant.gptq:  # its groups whole on every rank: read it in them
            g = Geometry.of(model.get_submodule(first.rpartition(".")[0]))
            key = param.key or GptqKeys.of_weight(first)
            scales = checkpoint.entries[key.scales].dtype if checkpoint is not None else torch.float16
            param = dataclasses.replace(param, gptq=tuple(GptqSlice.of(key, g.out_features, g.in_features, gptq, s,
                                                                       g.out_dim, scales) for s in param.shards))
        params[first] = param
    return Layout(plan, tp, heads, swaps, params)


def _quant_targets(model: nn.Module, swaps, quant: Quant, gptq: bool = False) -> dict[str, QuantTarget]:
    """The weights of the layers whose style says `quantizable` (the column- and row-parallel linears);
    embeddings, the output head (tied to the embedding in the families that matter most, so a quantized
    copy would add memory, not save it), experts, norms and biases stay in the model dtype."""
    return {f"{path}.weight": QuantTarget(quant, Geometry.of(model.get_submodule(path)).conv1d,
                                          isinstance(style, Rowwise), gptq)
            for path, style in swaps if getattr(style, "quantizable", False)}


class GroupError(AutotpError):
    """int4 groups that do not fit a tensor: the message is `reason` and this tensor's advice; prepare.py, which can
    try every tp and group size, replaces the advice with the ones that fit the whole model."""

    def __init__(self, reason: str, advice: str):
        super().__init__(reason + advice)
        self.reason = reason


def _check_groups(name: str, shape: tuple[int, ...], shards: tuple[TensorShard, ...], target: QuantTarget,
                  tp: int) -> None:
    """Every rank's inputs whole int4 groups (a GPTQ slice is read in whole groups; the kernel runs whole ones)."""
    group = target.quant.group_size
    in_dim = 0 if target.conv1d else 1
    inputs = shape[in_dim]
    what = "GPTQ stores" if target.gptq else "int4 quantizes"
    if inputs % group:
        fitting = [g for g in INT4_GROUPS if inputs % g == 0]
        advice = ("" if target.gptq else ": " + (f"use --group-size {' or '.join(map(str, fitting))}" if fitting
                                                  else "no int4 group size divides it") + ", or --quantize int8")
        raise GroupError(f"{what} {name} in groups of {group} input features, but it has {inputs}", advice)
    for rank, shard in enumerate(shards):
        cols = shard.ranges if shard.dim == in_dim else [(0, inputs)]
        if any(a % group or b % group for a, b in cols):
            a, b = next((a, b) for a, b in cols if a % group or b % group)
            raise GroupError(f"{what} {name} in groups of {group} input features, but at tp {tp} rank {rank} holds "
                             f"inputs {a}:{b} of {inputs}, which splits a group",
                             ": choose a tp whose split keeps whole groups"
                             + ("" if target.gptq else ", or --quantize int8"))


def _check_quantizable(param: Param, tp: int, device_type: str) -> None:
    """int4 groups whole on every rank, and every rank's slice a shape the device's kernel takes."""
    target = param.quant
    kind, group = target.quant.kind, target.quant.group_size
    in_dim = 0 if target.conv1d else 1
    if kind == "int4":
        _check_groups(param.name, param.shape, param.shards, target, tp)
    for rank in range(tp):
        local = param.local_shape(rank)
        why = kernel_fits(kind, local[1 - in_dim], local[in_dim], group, param.dtype, device_type)
        if why:
            verb = f"run {param.name}'s GPTQ weight in torch's int4 kernel" if target.gptq else \
                f"quantize {param.name} to {kind}"
            raise AutotpError(f"cannot {verb} at tp {tp} (rank {rank}): {why}")


def _swaps(model: nn.Module, plan: Plan) -> tuple[tuple[str, Style], ...]:
    """(path, style) of every module the plan names; a plan pattern that matches nothing is an error."""
    found, swaps = set(), []
    for path, _ in model.named_modules():
        hit = plan.match(path)
        if hit is not None:
            found.add(hit[0])
            swaps.append((path, hit[1]))
    missing = set(plan.layers) - found
    if missing:
        raise AutotpError(f"{plan.family} plan names modules this model does not have: {', '.join(sorted(missing))}")
    return tuple(swaps)


def _rank_shards(model: nn.Module, plan: Plan, swaps, names: dict[str, list[str]],
                 ctx: RankContext) -> dict[str, TensorShard]:
    """First name -> the part rank `ctx.rank` holds (REPLICATED where no style slices it)."""
    by_name: dict[str, TensorShard] = {}
    for path, style in swaps:
        module = model.get_submodule(path)
        for pname, shard in style.shards(module, ctx).items():
            param = getattr(module, pname, None)
            if param is None:
                continue
            if 0 in shard.local_shape(tuple(param.shape)):
                raise AutotpError(f"tp_size {ctx.tp} leaves rank {ctx.rank} an empty slice of {path}.{pname} "
                                  f"{tuple(param.shape)}: at most {param.shape[shard.dim]} ranks can share it")
            by_name[f"{path}.{pname}"] = shard
    shards = {}
    for first, all_names in names.items():
        distinct = {by_name.get(n, REPLICATED) for n in all_names}
        if len(distinct) > 1:
            raise AutotpError(f"tied weights {' and '.join(all_names)} are split differently by the {plan.family} plan")
        shards[first] = distinct.pop()
    return shards


def _checkpoint_keys(checkpoint: Checkpoint, model: nn.Module, plan: Plan, names: dict[str, list[str]],
                     gptq: dict[str, QuantTarget] | None = None) -> dict[str, str | ExpertKeys | GptqKeys]:
    """First name -> the checkpoint key holding it: any of its names, the older name the plan knows, or
    either without the model's base prefix (checkpoints saved from the base model, as GPT-2's and
    BLOOM's on the hub are, say `h.0.attn.c_attn.weight` for `transformer.h.0.attn.c_attn.weight`); for
    a fused experts parameter, its per-expert tensors where the plan's fused_sources name them; in a GPTQ
    checkpoint (`gptq`: the weights that could run GPTQ-quantized), for a weight stored quantized, its GPTQ
    tensors (`qweight` where `weight` would be). A GPTQ layer that the plan does not split column- or
    row-wise has no module that could run it: refused."""
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else None
    expected = {}
    for first, all_names in names.items():
        candidates = all_names + [plan.checkpoint_names[n] for n in all_names if n in plan.checkpoint_names]
        if prefix:
            candidates += [n.removeprefix(prefix) for n in candidates if n.startswith(prefix)]
        expected[first] = candidates
    metas = {first: model.get_parameter(first) for first in names}
    per_expert = {}
    for first, meta in metas.items():
        keys = plan.expert_keys(first, meta.shape[0]) if meta.dim() == 3 else None
        if keys is not None:
            per_expert[first] = ExpertKeys(tuple(meta.shape), keys)
    quantized = {}
    for first, candidates in expected.items() if gptq is not None else ():
        stored = [k for k in map(GptqKeys.of_weight, candidates) if k.qweight in checkpoint.entries]
        if stored and first not in gptq:
            raise AutotpError(f"{first} is stored GPTQ-quantized ({stored[0].qweight}), but the {plan.family} plan "
                              "does not split it column- or row-wise, the only layers autotp runs GPTQ weights in")
        if stored:
            quantized[first] = (stored[0], Geometry.of(model.get_submodule(first.rpartition(".")[0])),
                                gptq[first].quant.group_size)
    return match_keys(checkpoint, expected, metas, getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [],
                      per_expert, quantized)


def match_keys(checkpoint: Checkpoint, expected: dict[str, list[str]], params: dict[str, torch.Tensor],
               ignored: list[str] = (), per_expert: dict[str, ExpertKeys] | None = None,
               quantized: dict[str, tuple[GptqKeys, Geometry, int]] | None = None
               ) -> dict[str, str | ExpertKeys | GptqKeys]:
    """Match the model's parameters to checkpoint keys before loading; return first name -> key.

    expected: first name -> every name of that parameter (tied weights); params: first name -> the
    model's (meta) parameter, for the global shape and the kind of dtype it wants. per_expert: first
    name -> the per-expert tensors that may hold a fused experts parameter instead (its key is then
    that ExpertKeys). quantized: first name -> the GPTQ tensors stored instead of a linear weight, with the
    layer's geometry and group size (its key is then those GptqKeys). Missing, unused and mis-shaped
    tensors are errors, and so is integer data for a floating-point parameter or the reverse
    (`Checkpoint.read` converts between floating dtypes only); `ignored` are regexes of checkpoint keys the
    model declares it does not load (HF's `_keys_to_ignore_on_load_unexpected`).
    """
    keys, missing, claimed = {}, [], set()
    for first, (gptq_keys, geometry, group) in (quantized or {}).items():
        _check_gptq(checkpoint, gptq_keys, geometry, group)
        claimed.update(gptq_keys.all())
        keys[first] = gptq_keys
    for first, names in expected.items():
        if first in keys:
            continue
        present = [n for n in names if n in checkpoint.entries]
        split = (per_expert or {}).get(first)
        if not present and split is not None and any(k in checkpoint.entries for ks in split.keys for k in ks):
            absent = [k for ks in split.keys for k in ks if k not in checkpoint.entries]
            missing.extend(absent)
            claimed.update(k for ks in split.keys for k in ks)
            if not absent:
                keys[first] = split
                for k in (k for ks in split.keys for k in ks):
                    _check(checkpoint, k, split.part_shape(), params[first], first,
                                f" (one expert's part of {first} {split.shape})")
            continue
        if not present:
            missing.append(first)
            continue
        claimed.update(present)
        keys[first] = present[0]
        _check(checkpoint, present[0], tuple(params[first].shape), params[first], first)
    if missing:
        raise AutotpError(f"checkpoint in {checkpoint.directory} lacks {len(missing)} tensors the model needs: "
                          f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unused = [k for k in checkpoint.entries if k not in claimed and not any(re.search(p, k) for p in ignored)]
    if unused:
        raise AutotpError(f"checkpoint in {checkpoint.directory} has {len(unused)} tensors the model does not use: "
                          f"{', '.join(sorted(unused)[:5])}{' ...' if len(unused) > 5 else ''}")
    return keys


def _check_gptq(checkpoint: Checkpoint, keys: GptqKeys, geometry: Geometry, group: int) -> None:
    """A GPTQ layer's four tensors present, of the shapes an (out, in) weight in groups of `group` gives, int32
    (scales: floating)."""
    absent = [k for k in keys.all() if k not in checkpoint.entries]
    if absent:
        raise AutotpError(f"checkpoint in {checkpoint.directory} has {keys.qweight} but lacks {', '.join(absent)}")
    for key, shape in keys.shapes(geometry.out_features, geometry.in_features, group).items():
        entry = checkpoint.entries[key]
        if entry.shape != shape:
            raise AutotpError(f"GPTQ tensor {key} has shape {entry.shape}, but a ({geometry.out_features}, "
                              f"{geometry.in_features}) weight in groups of {group} gives {shape}")
        wants_float = key == keys.scales
        if entry.dtype.is_floating_point != wants_float or (not wants_float and entry.dtype != torch.int32):
            raise AutotpError(f"GPTQ tensor {key} in {entry.file} is stored as {DTYPE_NAMES[entry.dtype]}, not "
                              + ("a floating dtype" if wants_float else "I32"))


def _check(checkpoint: Checkpoint, key: str, shape: tuple[int, ...], want: torch.Tensor, first: str,
           note: str = "") -> None:
    """Tensor `key` has `shape` and the kind of dtype (floating or not) of the model's parameter `first`."""
    entry = checkpoint.entries[key]
    if entry.shape != shape:
        raise AutotpError(f"checkpoint tensor {key} has shape {entry.shape} but the config gives {shape}{note}")
    if entry.dtype.is_floating_point != want.dtype.is_floating_point:
        raise AutotpError(f"checkpoint tensor {key} in {entry.file} is stored as {DTYPE_NAMES[entry.dtype]}, "
                          f"but the model's {first} is {str(want.dtype).removeprefix('torch.')}")
