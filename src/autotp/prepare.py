"""The prologue every entry point shares, worked out once: config, plan, held dtype, quantization (asked for,
or a GPTQ checkpoint's, read from its config) and its kernel check for the device, checkpoint headers, and
the resolved layout.

`from_pretrained`, `init_inference` and `autotp plan` all start here (`autotp serve` through
`from_pretrained`), so one rule decides each of these facts and everything is checked before a weight is
read. Nothing here reads a weight or talks to another rank.

The held dtype: the one asked for, else the checkpoint's floating dtype, else the config's, else float32
(a loaded model: the one asked for, else its own).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from autotp.errors import AutotpError
from autotp.hub import load_config
from autotp.loading.checkpoint import INDEX, SINGLE, Checkpoint
from autotp.loading.skeleton import skeleton
from autotp.parallel.layout import Layout, resolve
from autotp.plans import Plan, plan_for
from autotp.quant.gptq import GptqFormat
from autotp.quant.weights import INT4_GROUP, INT4_GROUPS, Quant, check_kernel

INT4_TPS = 8  # where int4 does not fit at the tp asked for, the tp sizes tried for one that does (a host's GPUs)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise AutotpError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class Prepared:
    config: object
    plan: Plan
    dtype: torch.dtype  # what floating parameters are held in (quantized weights: their scales)
    quant: Quant | None
    gptq: GptqFormat | None  # the checkpoint stores its linear weights GPTQ-quantized
    checkpoint: Checkpoint | None  # its headers; None for a loaded model, or a config-only plan
    model: nn.Module  # a meta skeleton, or the user's loaded model (init_inference)
    layout: Layout


def _config_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def prepare(tp: int, device_type: str, *, model_dir: str | os.PathLike | None = None, model: nn.Module | None = None,
            dtype: str | torch.dtype | None = None, quantize: str | None = None, group_size: int = INT4_GROUP,
            checkpoint: bool = True, buffers: bool = True) -> Prepared:
    """Everything about loading `model_dir` (a meta skeleton of it; checkpoint=False: its headers only when
    it has safetensors files, as `autotp plan` wants) or sharding the loaded `model` at `tp` ranks of
    `device_type`, checked; raises AutotpError on anything that cannot load."""
    quant = Quant.parse(quantize, group_size)
    asked = parse_dtype(dtype)
    if model is not None:
        config, ckpt = model.config, None
        if getattr(config, "quantization_config", None) is not None:
            raise AutotpError("init_inference shards nn.Linear weights, and this model was loaded quantized "
                              "(config.quantization_config): pass the checkpoint's directory to "
                              "autotp.from_pretrained, which reads each rank's slice of a GPTQ checkpoint")
        gptq, held = None, asked or next(model.parameters()).dtype
    else:
        directory = Path(model_dir)
        config = load_config(directory)
        gptq = GptqFormat.of(config, directory)  # a format autotp cannot run is refused here, in one line
        if gptq is not None and quant is not None:
            raise AutotpError(f"{directory} is a GPTQ checkpoint, quantized already: drop --quantize {quantize}")
        has_weights = (directory / INDEX).exists() or (directory / SINGLE).exists()
        ckpt = Checkpoint(directory) if checkpoint or has_weights else None
        held = asked or (ckpt and ckpt.floating_dtype()) or _config_dtype(config) or torch.float32
    plan = plan_for(config)
    if quant is not None:
        check_kernel(quant.kind, device_type, held)
    if gptq is not None:
        check_kernel("int4", device_type, held, "a GPTQ checkpoint")
    net = model if model is not None else skeleton(config, held, buffers=buffers)
    kwargs = dict(dtype=asked if model is not None else None, device_type=device_type, gptq=gptq)
    try:
        layout = resolve(net, plan, tp, ckpt, quant, **kwargs)
    except AutotpError as e:
        if quant is None or quant.kind != "int4":
            raise
        resolve(net, plan, tp, ckpt, None, **kwargs)  # what fails without int4 is said as it is
        raise AutotpError(getattr(e, "reason", str(e)) + _int4_fits(net, plan, tp, ckpt, kwargs)) from None
    return Prepared(config, plan, held, quant, gptq, ckpt, net, layout)


def _int4_fits(net: nn.Module, plan: Plan, tp: int, ckpt: Checkpoint | None, kwargs: dict) -> str:
    """Where int4 does not fit at `tp`, the advice that does, tried on the whole model (every tensor's groups whole
    on every rank, every slice a shape the device's kernel packs): the group sizes that fit at this tp, else the tp
    sizes up to INT4_TPS that some group size fits, so that one refusal names what works. A few ms per try."""

    def fits(t: int, group: int) -> bool:
        try:
            resolve(net, plan, t, ckpt, Quant("int4", group), **kwargs)
        except AutotpError:
            return False
        return True

    here = [g for g in INT4_GROUPS if fits(tp, g)]
    if here:
        return f": at tp {tp} use --group-size {' or '.join(map(str, here))}, or --quantize int8"
    top = min(INT4_TPS, plan.num_heads)
    groups = {t: [g for g in INT4_GROUPS if fits(t, g)] for t in range(1, top + 1)}  # tp: none fit, by now
    tps = [t for t, fitting in groups.items() if fitting]
    if not tps:
        return f": no int4 group size fits this model at tp 1 to {top}: use --quantize int8"
    common = [g for g in INT4_GROUPS if all(g in groups[t] for t in tps)]
    sizes = f"with --group-size {' or '.join(map(str, common))}" if common else "each with a --group-size of its own"
    return (f": no int4 group size fits this model at tp {tp}; tp {' or '.join(map(str, tps))} do, {sizes}, or use "
            f"--quantize int8")
