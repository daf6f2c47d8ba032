"""Plans: for each model family, which module gets which parallel style. Data, not code.

A plan maps module path patterns (`*` stands for one path component, e.g. the layer index) to styles.
Every module a plan does not name is replicated, on purpose: layer norms, position embeddings, biases
of row-parallel layers. The attention modules' per-rank attributes that HF's forward reads are named
too, each mapped to the `HeadShard` property that gives its per-rank value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from autotp.errors import AutotpError
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
    unused_buffers: tuple[str, ...] = ()  # buffers HF builds but the forward never reads: freed on every rank
    source: str = "built-in"

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


def plan_for(config) -> Plan:
    """The built-in plan for `config.model_type`, or an error that lists the supported families."""
    from autotp.plans import gpt_bigcode

    builders = {"gpt_bigcode": gpt_bigcode.plan}
    family = getattr(config, "model_type", None)
    if family not in builders:
        raise AutotpError(f"unsupported architecture {family!r}: autotp has plans for {', '.join(sorted(builders))}")
    return builders[family](config)
