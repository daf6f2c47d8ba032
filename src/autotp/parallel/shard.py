"""Apply a resolved layout to a Hugging Face model for one rank: swap modules, fill tensors, set sizes.

Model-agnostic: what to swap and which part of each tensor the rank holds come from the `Layout`; the
tensor itself comes from a `produce` callback (the sliced checkpoint reader for `from_pretrained`, slicing
the already-loaded weight for `init_inference`). The model's forward is never touched; only the attention
modules' per-rank attributes named by the plan are set, and the model's config keeps the global sizes
(attention modules whose forward reads sizes from the config get a per-rank copy of it; inputs the model
builds for all heads, like ALiBi biases, are narrowed to the rank's heads by a hook on each attention).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from autotp.errors import AutotpError
from autotp.parallel.collectives import GroupRef
from autotp.parallel.head_inputs import NarrowHeads
from autotp.parallel.layout import Layout, Param
from autotp.parallel.slices import TensorShard
from autotp.parallel.styles import RankContext, Style
from autotp.quant.weights import QuantizedWeight

# produce(param, the rank's shard of it, the model's current parameter: meta, or the full loaded weight)
# -> the rank's tensor on its device, or its QuantizedWeight when the layout quantizes it
Produce = Callable[[Param, TensorShard, nn.Parameter], torch.Tensor | QuantizedWeight]


def parallelize(model: nn.Module, layout: Layout, rank: int, group: GroupRef | None, produce: Produce) -> None:
    """Turn `model` into rank `rank`'s part of the sharded model, in place.

    Planned modules are rebuilt at their per-rank shapes one by one, each full weight released as soon as
    its slice exists; every other parameter is passed through `produce` whole (REPLICATED).
    """
    plan, ctx = layout.plan, RankContext(rank, layout.tp, layout.heads[rank])
    done: dict[str, nn.Parameter] = {}  # first name -> per-rank Parameter, so tied weights stay tied

    for name in plan.unused_buffers:  # freed before the weights arrive, so they never add to the peak
        path, _, buffer = name.rpartition(".")
        setattr(model.get_submodule(path), buffer, None)

    def per_rank(name: str, current: nn.Parameter) -> nn.Parameter | QuantizedWeight:
        param = layout.param(name)
        if param.name not in done:
            value = produce(param, param.shards[rank], current)
            done[param.name] = value if isinstance(value, QuantizedWeight) else nn.Parameter(value, requires_grad=False)
        return done[param.name]

    def swap(path: str, style: Style) -> None:  # a function, so the old module is released when it returns
        module = model.get_submodule(path)
        shards = {pname: layout.param(f"{path}.{pname}").shards for pname, _ in module.named_parameters(recurse=False)}
        new = style.build(module, shards, ctx, group)
        for pname, param in module.named_parameters(recurse=False):
            value = per_rank(f"{path}.{pname}", param)
            if isinstance(value, QuantizedWeight):  # a module where the layer had a Parameter
                delattr(new, pname)
            setattr(new, pname, value)
        model.set_submodule(path, new)

    for path, style in layout.swaps:
        swap(path, style)

    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if done.get(layout.param(name).name) is not param:
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
            module.autotp_heads = ctx.heads  # for code that builds a per-head input itself (serve's adapters)
            if plan.head_inputs:  # e.g. ALiBi biases built for all heads: this rank's heads only
                module.register_forward_pre_hook(NarrowHeads(plan.head_inputs, ctx.heads), with_kwargs=True)
