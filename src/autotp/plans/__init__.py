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
    # Config attributes the attention forward reads as sizes (Phi-3 slices its fused qkv at
    # config.num_attention_heads * head_dim): the attention modules get one per-rank shallow copy of the
    # config with these set to the HeadShard property; the model's own config keeps the global numbers.
    attention_config: dict[str, str] = field(default_factory=dict)
    unused_buffers: tuple[str, ...] = ()  # buffers HF builds but the forward never reads: freed on every rank
    source: str = "built-in"
    # model parameter name -> the name older checkpoints store it under (transformers 5 renames some on
    # load, e.g. GPT-NeoX's embed_out.weight is lm_head.weight); either name satisfies the loader.
    checkpoint_names: dict[str, str] = field(default_factory=dict)

    def parameter_names(self, model) -> dict[str, list[str]]:
        """Each parameter's first name -> every name it may have in a checkpoint (ties and old names)."""
        from autotp.shard import parameter_names

        return {first: names + [self.checkpoint_names[n] for n in names if n in self.checkpoint_names]
                for first, names in parameter_names(model).items()}

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


def head_count(config, heads: str) -> int:
    """config.<heads>, checked to be a positive integer: a count of 0 would otherwise surface as a
    ZeroDivisionError in the head_dim division or the head assignment."""
    n = getattr(config, heads)
    if type(n) is not int or n < 1:
        raise AutotpError(f"config.json gives {heads}={n!r}: a model needs at least 1 attention head")
    return n


def head_dim(config, hidden: str, heads: str) -> int:
    """config.<hidden> // config.<heads>, for configs whose heads split the hidden size evenly."""
    n, size = head_count(config, heads), getattr(config, hidden)
    if size % n:
        raise AutotpError(f"config.json gives {hidden}={size}, which does not split into {heads}={n} heads "
                          f"of equal size ({size} % {n} = {size % n})")
    return size // n


def _matches(pattern: str, path: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), path) is not None


def builtin_plans() -> dict:
    """model_type -> plan builder(config) for every family with a built-in plan."""
    from autotp.plans import falcon, gpt2, gpt_bigcode, gpt_neox, llama, opt, phi3

    return {"gpt_bigcode": gpt_bigcode.plan, "gpt2": gpt2.plan, "gpt_neox": gpt_neox.plan, "gptj": gpt_neox.gptj_plan,
            "falcon": falcon.plan, "opt": opt.plan, "phi3": phi3.plan} | {f: llama.plan for f in llama.FAMILIES}


def plan_for(config) -> Plan:
    """The built-in plan for `config.model_type`, else one inferred from the model's module tree.

    An inferred plan is used only when nothing about it is ambiguous; otherwise the error prints what was
    inferred and how to add a built-in plan.
    """
    from autotp.plans.infer import infer_plan

    builders = builtin_plans()
    family = getattr(config, "model_type", None)
    if family in builders:
        return builders[family](config)
    return infer_plan(config, supported=sorted(builders))
