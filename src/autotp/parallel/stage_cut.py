"""One pipeline stage's part of a model: the decoder layers it holds, and stubs where the other stages' parts were.

The model stays Hugging Face's and its forward runs whole on every stage, but on stage s:
- a decoder layer another stage holds is a `Passthrough` (no weights; what it returns is never used);
- past stage 0, the input embedding and every other plain nn.Embedding outside the layers (learned positions) is a
  `ZeroEmbedding`: zeros of the right shape and dtype, so that what the forward builds from them before the layers
  (rotary tables, masks, ALiBi biases) is built as usual, while the layers themselves get the hidden states the
  stage before sent (stage_io.StageIO);
- before the last stage, the LM head is a `NoHead`: the forward stops after the stage's last layer.
Modules outside the layers that are small (norms, an embedding with a forward of its own such as OPT's positions)
stay on every stage.

The cut is made on the meta skeleton, before any weight is read. The stage's layout is the whole model's (resolved
and checked against the whole checkpoint once, as without a pipeline) restricted to what is left: each rank reads its
stage's layers of its tensor-parallel slice, and a tied embedding only where it is used (on the last stage, as the
LM head's weight).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autotp.errors import AutotpError
from autotp.parallel.layout import Layout
from autotp.parallel.stages import Stages
from autotp.plans import Plan


class _Skipped:
    """What a Passthrough returns: indexing it gives itself, so a forward that takes `outputs[0]` of a layer (BLOOM,
    Falcon, MPT) and one that takes the output itself both carry it on to the next layer unharmed."""

    def __getitem__(self, _):
        return self


SKIPPED = _Skipped()


class Passthrough(nn.Module):
    """A decoder layer another stage holds."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        return SKIPPED

    def extra_repr(self) -> str:
        return f"layer {self.index}: another stage's"


class ZeroEmbedding(nn.Module):
    """An embedding only stage 0 reads: zeros (*ids, dim), the shape and dtype of the real one's output."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim = dim
        self.register_buffer("zero", torch.zeros((), dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.zero.new_zeros((*ids.shape, self.dim))

    def extra_repr(self) -> str:
        return f"dim {self.dim}: stage 0's"


class NoHead(nn.Module):
    """The LM head, on a stage before the last: never reached (the stage's forward ends at its last layer)."""

    def forward(self, *args, **kwargs):
        raise AutotpError("the LM head runs on the last pipeline stage only")


STUBS = (Passthrough, ZeroEmbedding, NoHead)


def layers_path(plan: Plan) -> str:
    """The path of the decoder layers' ModuleList: the plan's attention pattern up to its `*` (`model.layers`)."""
    head, star, _ = plan.attention.partition(".*")
    if not star:
        raise AutotpError(f"the {plan.family} plan's attention pattern {plan.attention!r} names no layer list")
    return head


def decoder_layers(model: nn.Module, plan: Plan) -> nn.ModuleList:
    layers = model.get_submodule(layers_path(plan))
    if not isinstance(layers, nn.ModuleList):
        raise AutotpError(f"{plan.family}: {layers_path(plan)} is a {type(layers).__name__}, not the decoder layers")
    return layers


def cut(model: nn.Module, layout: Layout, stages: Stages, stage: int) -> Layout:
    """Turn the meta skeleton `model` into stage `stage`'s (the module docstring), in place; returns the stage's
    layout: `layout`'s parameters and module swaps that are left."""
    path = layers_path(layout.plan)
    layers = decoder_layers(model, layout.plan)
    if len(layers) != sum(stages.layers):
        raise AutotpError(f"the pipeline splits {sum(stages.layers)} layers but {path} has {len(layers)}")
    span = stages.span(stage)
    for i in range(len(layers)):
        if i not in span:
            layers[i] = Passthrough(i)
    head = model.get_output_embeddings()
    heads = [name for name, m in model.named_modules() if head is not None and m is head]
    if stage < stages.pp - 1:
        for name in heads:
            model.set_submodule(name, NoHead())
    if stage > 0:
        first = model.get_input_embeddings()
        for name, m in list(model.named_modules()):
            outside = not name.startswith(f"{path}.")
            plain = type(m) is nn.Embedding or m is first
            if outside and plain and isinstance(m, nn.Embedding) and m is not head:
                model.set_submodule(name, ZeroEmbedding(m.embedding_dim, m.weight.dtype))
    return _restricted(layout, model)


def _restricted(layout: Layout, model: nn.Module) -> Layout:
    """`layout` with only the parameters `model` still has (by any of their names) and the swaps of modules it still
    has, stubs excepted."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    params = {first: p for first, p in layout.params.items() if names & {p.name, *p.aliases}}
    modules = dict(model.named_modules())
    swaps = tuple((path, style) for path, style in layout.swaps
                  if path in modules and not isinstance(modules[path], STUBS))
    return dataclasses.replace(layout, swaps=swaps, params=params)
