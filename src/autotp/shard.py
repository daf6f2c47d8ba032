"""Apply a plan to a Hugging Face model: swap planned modules for per-rank ones and fill their tensors.

Model-agnostic: what to swap comes from the plan, what tensor each parameter gets comes from a `load`
callback (the sliced checkpoint reader, or slicing an already-loaded weight). The model's forward is
never touched; only the attention modules' per-rank attributes named by the plan are set, and the
model's config keeps the global sizes (attention modules whose forward reads sizes from the config get
a per-rank copy of it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from autotp.errors import AutotpError
from autotp.plans import Plan
from autotp.styles import REPLICATED, RankContext, TensorShard

# load(names, shard, meta_or_old_param) -> the rank's tensor. `names` are every name the parameter is
# reachable by (tied weights have several); the checkpoint holds at least one of them.
Load = Callable[[list[str], TensorShard, nn.Parameter], torch.Tensor]


def parameter_names(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name -> all its names (tied weights have several), in registration order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _planned_modules(model: nn.Module, plan: Plan):
    """(path, module, style) of every module the plan names; a plan pattern that matches nothing is an error."""
    found, planned = set(), []
    for path, module in model.named_modules():
        hit = plan.match(path)
        if hit is not None:
            found.add(hit[0])
            planned.append((path, module, hit[1]))
    missing = set(plan.layers) - found
    if missing:
        raise AutotpError(f"{plan.family} plan names modules this model does not have: {', '.join(sorted(missing))}")
    return planned


def rank_shards(model: nn.Module, plan: Plan, tp: int) -> list[dict[str, TensorShard]]:
    """For each rank, every parameter name -> the part of it that rank holds (REPLICATED if unplanned).

    Works on a meta-device model, so `autotp plan` can show StarCoder's partition from its config alone.
    Raises if a rank would get an empty slice or tied weights would be split differently.
    """
    heads = plan.heads(tp)
    planned = list(_planned_modules(model, plan))
    per_rank = []
    for rank in range(tp):
        ctx = RankContext(rank, tp, heads[rank])
        shards = {name: REPLICATED for name, _ in model.named_parameters(remove_duplicate=False)}
        for path, module, style in planned:
            for pname, shard in style.shards(module, ctx).items():
                param = getattr(module, pname, None)
                if param is None:
                    continue
                if 0 in shard.local_shape(tuple(param.shape)):
                    raise AutotpError(
                        f"tp_size {tp} leaves rank {rank} an empty slice of {path}.{pname} "
                        f"{tuple(param.shape)}: at most {param.shape[shard.dim]} ranks can share it"
                    )
                shards[f"{path}.{pname}"] = shard
        for names in parameter_names(model).values():
            if len({shards[n] for n in names}) > 1:
                raise AutotpError(f"tied weights {' and '.join(names)} are split differently by the {plan.family} plan")
        per_rank.append(shards)
    return per_rank


def parallelize(model: nn.Module, plan: Plan, rank: int, tp: int, group, load: Load) -> None:
    """Turn `model` into rank `rank`'s part of a `tp`-way sharded model, in place.

    Planned modules are rebuilt at their per-rank shapes one by one (so slicing a loaded model frees each
    full weight as soon as its slice exists); every other parameter is passed through `load` whole.
    """
    shards = rank_shards(model, plan, tp)[rank]
    aliases = parameter_names(model)
    first = {name: names[0] for names in aliases.values() for name in names}
    ctx = RankContext(rank, tp, plan.heads(tp)[rank])
    done: dict[str, nn.Parameter] = {}  # first name -> per-rank Parameter, so tied weights stay tied

    for name in plan.unused_buffers:  # freed before the weights arrive, so they never add to the peak
        path, _, buffer = name.rpartition(".")
        setattr(model.get_submodule(path), buffer, None)

    def per_rank(name: str, param: nn.Parameter) -> nn.Parameter:
        key = first[name]
        if key not in done:
            done[key] = nn.Parameter(load(aliases[key], shards[key], param), requires_grad=False)
        return done[key]

    def swap(path: str, style) -> None:
        module = model.get_submodule(path)
        new = style.build(module, style.shards(module, ctx), ctx, group)
        for pname, param in module.named_parameters(recurse=False):
            setattr(new, pname, per_rank(f"{path}.{pname}", param))
        model.set_submodule(path, new)

    # paths only, each module looked up (and its full weights released) in its turn: a list holding the
    # modules kept every full weight alive until the last swap (init_inference at tp 1 held 2x the model)
    for path, style in [(path, style) for path, _, style in _planned_modules(model, plan)]:
        swap(path, style)

    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if done.get(first[name]) is not param:
            path, _, pname = name.rpartition(".")
            setattr(model.get_submodule(path), pname, per_rank(name, param))

    rank_config = copy.copy(model.config)  # shallow: only the attention_config sizes differ from the model's
    for attr, prop in plan.attention_config.items():
        setattr(rank_config, attr, getattr(ctx.heads, prop))
    for path, module in model.named_modules():
        if plan.is_attention(path):
            for attr, prop in plan.attention_attrs.items():
                if not hasattr(module, attr):
                    raise AutotpError(f"{plan.family} plan sets {path}.{attr}, which this transformers version lacks")
                setattr(module, attr, getattr(ctx.heads, prop))
            if plan.attention_config:
                module.config = rank_config
