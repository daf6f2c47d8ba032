"""A plan: for one model family, which module gets which parallel style. Pure data.

A plan maps module path patterns (`*` stands for one path component, e.g. the layer index) to styles.
Every module a plan does not name is replicated, on purpose: layer norms, position embeddings, biases
of row-parallel layers. The attention modules' per-rank attributes that HF's forward reads are named
too, each mapped to the `HeadShard` property that gives its per-rank value. What a plan means for one
model at one tp size (each parameter's slice on each rank) is worked out once, by `autotp.parallel.layout`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from autotp.parallel.partition import HeadShard, assign_heads
from autotp.parallel.styles import Style


@dataclass(frozen=True)
class FusedSource:
    """How checkpoints store a fused experts parameter (experts, rows, cols) the hub's way: one 2-D tensor per
    expert and part, each (rows / len(parts), cols). Expert e's matrix is its parts concatenated along rows,
    in order, and the experts are stacked: transformers' own `MergeModulelist(dim=0)` then
    `Concatenate(dim=1)` (conversion_mapping.py), e.g. Mixtral's gate_up_proj = [w1 (gate) | w3 (up)] per
    expert. Each part is a key template: `*` takes the parameter's matched path components, in order, and
    `{expert}` the expert's index."""

    parts: tuple[str, ...]

    def keys(self, stars: tuple[str, ...], experts: int) -> tuple[tuple[str, ...], ...]:
        """[expert][part] -> checkpoint key, for a parameter whose pattern's `*`s matched `stars`."""
        filled = []
        for template in self.parts:
            pieces = template.split("*")
            if len(pieces) != len(stars) + 1:
                raise ValueError(f"key template {template} has {len(pieces) - 1} '*' but its pattern {len(stars)}")
            filled.append("".join(p + s for p, s in zip(pieces, (*stars, ""), strict=True)))
        return tuple(tuple(t.replace("{expert}", str(e)) for t in filled) for e in range(experts))


@dataclass(frozen=True)
class Plan:
    family: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: dict[str, Style]
    attention: str  # module path pattern of the attention modules
    attention_attrs: dict[str, str] = field(default_factory=dict)  # attribute -> HeadShard property
    # Config attributes the attention forward reads as sizes (Phi-3 slices its fused qkv at
    # config.num_attention_heads * head_dim): the attention modules get one per-rank shallow copy of the
    # config with these set to the HeadShard property; the model's own config keeps the global numbers.
    attention_config: dict[str, str] = field(default_factory=dict)
    # Keyword arguments of the attention forward that the model builds for all heads (ALiBi biases, masks
    # with the bias folded in), heads at dim -3: each rank's attention gets only its heads
    # (autotp.parallel.head_inputs).
    head_inputs: tuple[str, ...] = ()
    unused_buffers: tuple[str, ...] = ()  # buffers HF builds but the forward never reads: freed on every rank
    source: str = "built-in"
    # model parameter name -> the name older checkpoints store it under (transformers 5 renames some on
    # load, e.g. GPT-NeoX's embed_out.weight is lm_head.weight); either name satisfies the loader.
    checkpoint_names: dict[str, str] = field(default_factory=dict)
    # parameter pattern -> how checkpoints may store it per expert instead (see FusedSource); the fused
    # tensor under the model's own name is accepted too.
    fused_sources: dict[str, FusedSource] = field(default_factory=dict)

    def heads(self, tp: int) -> list[HeadShard]:
        return assign_heads(self.num_heads, self.num_kv_heads, self.head_dim, tp)

    def match(self, path: str) -> tuple[str, Style] | None:
        """The first (pattern, style) whose pattern matches module path `path`."""
        for pattern, style in self.layers.items():
            if _matches(pattern, path):
                return pattern, style
        return None

    def is_attention(self, path: str) -> bool:
        return _matches(self.attention, path)

    def expert_keys(self, name: str, experts: int) -> tuple[tuple[str, ...], ...] | None:
        """[expert][part] -> the per-expert checkpoint keys of parameter `name`, if a fused source names it."""
        for pattern, source in self.fused_sources.items():
            hit = re.fullmatch(_regex(pattern, "([^.]+)"), name)
            if hit is not None:
                return source.keys(hit.groups(), experts)
        return None


def _regex(pattern: str, star: str) -> str:
    return re.escape(pattern).replace(r"\*", star)


def _matches(pattern: str, path: str) -> bool:
    return re.fullmatch(_regex(pattern, r"[^.]+"), path) is not None
