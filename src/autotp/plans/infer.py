"""Inferred plans for families without a built-in one: read the module tree and config, refuse when in doubt.

The decoder layers are the ModuleList of `num_hidden_layers` blocks; layer 0's linears (nn.Linear, or HF
Conv1D whose weight is (in, out)) are classified by shape and registration order:
- attention (the submodule whose class is an *Attention): the last linear reads heads*d and writes the
  residual stream (hidden) -> row-parallel by query heads; each one before it reads hidden and writes
  heads*d (query) or kv_heads*d (key/value) -> column-parallel by query or KV heads.
- every other linear of the layer (the MLP): the last writes hidden -> row-parallel; the ones before it
  read hidden and write its input -> column-parallel, split evenly.
Input embedding -> vocab-parallel, output embedding -> vocab-parallel with gathered logits.

Anything a shape cannot settle is refused, with the inferred plan printed: fused projections (their
layout, blocks or per-head interleaved, is not in the shape), norms across heads (OLMo-2's q_norm over
heads*d), a forward that reads head counts from the config or takes per-head ALiBi biases built for all
heads, size attributes whose meaning is unknown, MoE routers. A forward whose source is not installed
(zipapps, some frozen installs) cannot be checked for the last two, so it is refused too.
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from autotp.errors import AutotpError
from autotp.loading.skeleton import skeleton
from autotp.parallel.styles import Colwise, Rowwise, Style, Vocab, VocabHead
from autotp.plans.common import llama_heads
from autotp.plans.plan import Plan

# Attention attributes whose meaning is known -> the HeadShard property that gives their per-rank value.
KNOWN_ATTRS = {"num_heads": "q_heads", "num_attention_heads": "q_heads", "num_key_value_heads": "kv_heads",
               "num_kv_heads": "kv_heads", "num_key_value_groups": "q_per_kv", "embed_dim": "q_dim",
               "hidden_size": "q_dim", "split_size": "q_dim"}
CONFIG_SIZES = re.compile(r"config\.(num_attention_heads|num_key_value_heads|n_head|hidden_size|num_heads)\b")
KV_NAME = re.compile(r"(k|v|key|value)(_proj)?$")


def _sizes(config) -> tuple[int, int, int, int]:
    try:
        heads, kv_heads, d = llama_heads(config)
        return heads, kv_heads, d, config.hidden_size
    except AttributeError as e:
        raise AutotpError(f"cannot infer a plan for {config.model_type!r}: its config has no {e.name}") from None


def _in_out(m: nn.Module) -> tuple[int, int]:
    return (m.nx, m.nf) if isinstance(m, Conv1D) else (m.in_features, m.out_features)


def infer_plan(config, supported: list[str] = ()) -> Plan:
    """A plan from the model's module tree; an AutotpError with the inferred plan when anything is ambiguous."""
    heads, kv_heads, d, hidden = _sizes(config)
    try:
        model = skeleton(config, torch.float32, buffers=False)
    except (ValueError, KeyError) as e:
        raise AutotpError(f"unsupported architecture {config.model_type!r}: not a known causal LM ({e})") from None
    paths = {id(m): p for p, m in model.named_modules()}
    layers: dict[str, Style] = {}
    problems: list[str] = []
    attention, attrs = "", {}

    stacks = [p for p, m in model.named_modules()
              if isinstance(m, nn.ModuleList) and len(m) == getattr(config, "num_hidden_layers", -1)]
    if len(stacks) != 1:
        problems.append(f"found {len(stacks)} module lists of num_hidden_layers blocks, expected 1")
    else:
        layer = model.get_submodule(f"{stacks[0]}.0")
        prefix = f"{stacks[0]}.*."
        attns = [(p, m) for p, m in layer.named_modules() if type(m).__name__.endswith("Attention")]
        linears = [(p, m) for p, m in layer.named_modules() if isinstance(m, nn.Linear | Conv1D)]
        if len(attns) != 1:
            problems.append(f"found {len(attns)} attention modules in a layer, expected 1")
        else:
            apath, attn = attns[0]
            attention = prefix + apath
            inside = [(p, m) for p, m in linears if p.startswith(apath + ".")]
            linears = [(p, m) for p, m in linears if not p.startswith(apath + ".")]
            layers |= {prefix + p: s for p, s in _attention_styles(inside, heads, kv_heads, d, hidden, problems)}
            attrs = _attention_attrs(attn, heads, kv_heads, d, problems)
        layers |= {prefix + p: s for p, s in _mlp_styles(linears, hidden, problems)}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embed, nn.Embedding):
        layers = {paths[id(embed)]: Vocab()} | layers
    if isinstance(head, nn.Linear):
        layers[paths[id(head)]] = VocabHead()

    plan = Plan(family=config.model_type, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, layers=layers,
                attention=attention, attention_attrs=attrs, source="inferred")
    if problems:
        shown = "\n".join(f"  {p}: {s}" for p, s in layers.items())
        raise AutotpError(
            f"no built-in plan for {config.model_type!r} and the inferred one is ambiguous: {'; '.join(problems)}.\n"
            f"Inferred ({heads} query heads / {kv_heads} KV heads of {d}):\n{shown}\n"
            f"Built-in plans: {', '.join(supported)}. To add one, write src/autotp/plans/<family>.py returning "
            "a Plan (see plans/llama.py) and register it in plans.builtin_plans()."
        )
    return plan


def _attention_styles(linears, heads, kv_heads, d, hidden, problems) -> list[tuple[str, Style]]:
    if not linears:
        problems.append("the attention module holds no linear layers")
        return []
    *qkv, (opath, out) = linears
    styles = []
    if _in_out(out) != (heads * d, hidden):
        problems.append(f"{opath} {_in_out(out)} is not the (heads*d, hidden) = ({heads * d}, {hidden}) output")
    else:
        styles.append((opath, Rowwise(split="q_heads")))
    for path, m in qkv:
        i, o = _in_out(m)
        name = path.rpartition(".")[2]
        if i == hidden and o == kv_heads * d and (kv_heads != heads or KV_NAME.match(name)):
            styles.append((path, Colwise(split="kv_heads")))
        elif i == hidden and o == heads * d:
            styles.append((path, Colwise(split="q_heads")))
        else:
            problems.append(f"{path} {(i, o)} is neither a query ({heads * d}) nor a key/value ({kv_heads * d}) "
                            "projection of hidden; fused projections need a built-in plan")
    kinds = [s.split for _, s in styles if isinstance(s, Colwise)]
    if not problems and sorted(kinds) != ["kv_heads", "kv_heads", "q_heads"] and kinds != ["q_heads"] * 3:
        problems.append(f"attention projections {kinds} are not one query and two key/value projections")
    return sorted(styles, key=lambda ps: [p for p, _ in linears].index(ps[0]))


def _attention_attrs(attn, heads, kv_heads, d, problems) -> dict[str, str]:
    try:
        source = inspect.getsource(type(attn).forward)
    except (OSError, TypeError) as e:  # no .py file installed, or a forward that is not Python
        problems.append(f"cannot read the source of {type(attn).__name__}.forward to check it ({e})")
        source = ""
    if CONFIG_SIZES.search(source):
        problems.append(f"{type(attn).__name__}.forward reads head counts from the config")
    if "alibi" in source:
        problems.append(f"{type(attn).__name__}.forward takes ALiBi biases built for all {heads} heads")
    for _, sub in attn.named_modules():
        if not isinstance(sub, nn.Linear | Conv1D) and any(
                {heads * d, kv_heads * d} & set(p.shape) - {d} for p in sub.parameters(recurse=False)):
            problems.append(f"{type(sub).__name__} in the attention acts across heads")
    sizes = {heads, heads * d, kv_heads * d, kv_heads, heads // kv_heads} - {d, 1}
    attrs = {}
    for name, value in vars(attn).items():
        if type(value) is not int or name in ("layer_idx", "head_dim"):
            continue
        if name in KNOWN_ATTRS:
            attrs[name] = KNOWN_ATTRS[name]
        elif value in sizes:
            problems.append(f"attention attribute {name} = {value} may be a head count or size")
    return attrs


def _mlp_styles(linears, hidden, problems) -> list[tuple[str, Style]]:
    if not linears:
        problems.append("no MLP linear layers outside the attention")
        return []
    *cols, (rpath, row) = linears
    r_in, r_out = _in_out(row)
    if r_out != hidden:
        problems.append(f"{rpath} {(r_in, r_out)} does not write the residual stream ({hidden})")
    for path, m in cols:
        if _in_out(m) != (hidden, r_in):
            problems.append(f"{path} {_in_out(m)} is not a ({hidden}, {r_in}) projection into {rpath}")
    return [(p, Colwise()) for p, _ in cols] + [(rpath, Rowwise())]
