"""A plan: for one model family, which module gets which parallel style. Pure data.

A plan maps module path patterns (`*` stands for one path component, e.g. the layer index) to styles.
Every module a plan does not name is replicated, on purpose: layer norms, position embeddings, biases
of row-parallel layers. The attention modules' per-rank attributes that HF's forward reads are named
too, each mapped to the `HeadShard` property that gives its per-rank value. What a plan means for one
model at one tp size (each parameter's slice on each rank) is worked out once, by `autotp.layout`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from autotp.partition import HeadShard, assign_heads
from autotp.styles import Style


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
    # with the bias folded in), heads at dim -3: each rank's attention gets only its heads (autotp.head_inputs).
    head_inputs: tuple[str, ...] = ()
    unused_buffers: tuple[str, ...] = ()  # buffers HF builds but the forward never reads: freed on every rank
    source: str = "built-in"
    # model parameter name -> the name older checkpoints store it under (transformers 5 renames some on
    # load, e.g. GPT-NeoX's embed_out.weight is lm_head.weight); either name satisfies the loader.
    checkpoint_names: dict[str, str] = field(default_factory=dict)

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


def _matches(pattern: str, path: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), path) is not None
