"""The library entry points: `from_pretrained` (sliced loading) and `init_inference` (DeepSpeed drop-in).

Both resolve the model's layout first (`layout.resolve`: architecture, tp size against heads, checkpoint
keys, shapes and dtypes, all before any weight is read), then differ only in the function that produces
each rank's tensor: read the slice from the checkpoint, or cut it from the weight already loaded.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from autotp import deepspeed_compat, distributed
from autotp.collectives import GroupRef
from autotp.deepspeed_compat import InferenceEngine
from autotp.errors import AutotpError
from autotp.guard import InputGuard
from autotp.hub import load_config, resolve_model_dir
from autotp.layout import Param, resolve
from autotp.loader import Checkpoint
from autotp.memory import release_freed
from autotp.plans import Plan, plan_for
from autotp.quant import INT4_GROUP, Quant, QuantizedWeight, check_kernel
from autotp.quant_load import quantize_loaded, quantize_slice
from autotp.shard import parallelize
from autotp.skeleton import skeleton
from autotp.styles import TensorShard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ShardInfo:
    """What autotp did to a model, kept on it as `model.autotp`."""

    family: str
    tp: int
    rank: int
    param_bytes: int  # bytes of the parameters this rank holds
    bytes_read: int = 0  # checkpoint bytes this rank read (0 for init_inference)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise AutotpError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _check_tp(tp: int | None, world: int) -> int:
    if tp is None:
        return world
    if tp != world:
        raise AutotpError(f"tp_size {tp} does not match the {world} launched processes (WORLD_SIZE): "
                          f"launch {tp} processes, e.g. torchrun --nproc-per-node {tp}")
    return tp


def _param_bytes(model: nn.Module) -> int:
    """Bytes of the weights this rank holds: parameters, and quantized weights with their scales."""
    quantized = sum(m.nbytes() for m in model.modules() if isinstance(m, QuantizedWeight))
    return quantized + sum(p.numel() * p.element_size() for p in model.parameters())


def from_pretrained(model: str | os.PathLike, dtype: str | torch.dtype | None = None, tp_size: int | None = None,
                    device: str | torch.device | None = None, check_inputs: bool = True,
                    quantize: str | None = None, group_size: int = INT4_GROUP) -> nn.Module:
    """Load this rank's shard of a safetensors causal LM; every rank reads only its own slices (of each
    expert's tensor, too, where an MoE checkpoint stores the experts one tensor each, as the hub's do).

    model: a local directory or a hub id (downloaded once per node). dtype: None keeps the checkpoint's
    floating dtype. tp_size: defaults to WORLD_SIZE (must equal it). device: defaults to
    cuda:LOCAL_RANK or cpu. check_inputs: raise when ranks feed different input ids (autotp.guard).
    quantize: "int8" or "int4" (group_size input features per group) stores the linear layers' weights
    quantized, each slice quantized as it is read (autotp.quant).
    """
    quant = Quant.parse(quantize, group_size)
    dtype = parse_dtype(dtype)
    env = distributed.init(device)
    tp = _check_tp(tp_size, env.world_size)
    model_dir = resolve_model_dir(model)
    config = load_config(model_dir)
    plan = _plan(config)
    ckpt = Checkpoint(model_dir)
    dtype = dtype or ckpt.floating_dtype() or torch.float32
    net = skeleton(config, dtype)
    if quant is not None:
        check_kernel(quant.kind, env.device, dtype)
    layout = resolve(net, plan, tp, ckpt, quant, device_type=env.device.type)  # all checked before reading
    progress = tqdm(total=len(layout.params), desc=f"loading {plan.family} tp={tp}", unit="tensor",
                    disable=env.rank != 0 or not sys.stderr.isatty())

    def read(param: Param, shard: TensorShard, meta: nn.Parameter) -> torch.Tensor | QuantizedWeight:
        progress.update()
        if param.quant is not None:
            weight = quantize_slice(lambda rows: ckpt.row_blocks(param.key, shard, dtype, rows), param.quant,
                                    param.local_shape(env.rank), dtype, env.device,
                                    lambda row_max: distributed.all_reduce_max(row_max, env))
            release_freed()  # the slice's temporaries, before the next tensor's (autotp.memory)
            return weight
        return ckpt.read(param.key, shard, dtype if meta.is_floating_point() else None).to(env.device)

    parallelize(net, layout, env.rank, GroupRef.of(env.group), read)
    progress.close()
    net.to(env.device)
    net.autotp = ShardInfo(plan.family, tp, env.rank, _param_bytes(net), ckpt.bytes_read)
    _finish(net, env, check_inputs)
    return net


def _plan(config) -> Plan:
    """The family's plan; an inferred one is announced on rank 0, with how to see or refuse it."""
    plan = plan_for(config)
    if plan.source == "inferred":
        distributed.print0(f"autotp: no built-in plan for {plan.family}: using one inferred from its modules "
                           "(`autotp plan --model DIR --tp N` prints it; AUTOTP_INFERRED_PLANS=0 refuses it)",
                           file=sys.stderr)
    return plan


def _finish(model: nn.Module, env: distributed.Dist, check_inputs: bool) -> None:
    """What every sharded model gets last: rank 0's random state on every rank (so a user's own
    unseeded sampling agrees), and the guard against ranks that feed different inputs anyway."""
    distributed.sync_random_state(env)
    if check_inputs and env.group is not None:
        guard = InputGuard(GroupRef.of(env.group), distributed.wire_device(env))
        model.register_forward_pre_hook(guard, with_kwargs=True)


def init_inference(model: nn.Module, mp_size: int | None = None, tensor_parallel=None,
                   dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
                   check_inputs: bool = True, quantize: str | None = None, group_size: int = INT4_GROUP,
                   **kwargs) -> InferenceEngine:
    """Shard an already-loaded HF model in place, DeepSpeed-style.

    Accepts DeepSpeed's call shapes: `init_inference(model, mp_size=4)` and
    `init_inference(model, tensor_parallel={"enabled": True, "tp_size": 4})`. Each planned weight is
    sliced (and quantized, with `quantize=`) and the full one dropped module by module; DeepSpeed
    kernel-injection options are ignored.
    """
    mp_size = deepspeed_compat.tp_size(mp_size, tensor_parallel, kwargs)
    quant = Quant.parse(quantize, group_size)
    dtype = parse_dtype(dtype)
    env = distributed.init(device)
    tp = _check_tp(mp_size, env.world_size)
    plan = _plan(model.config)
    if quant is not None:
        check_kernel(quant.kind, env.device, dtype or next(model.parameters()).dtype)
    layout = resolve(model, plan, tp, quant=quant, dtype=dtype, device_type=env.device.type)

    def take(param: Param, shard: TensorShard, full: nn.Parameter) -> torch.Tensor | QuantizedWeight:
        if param.quant is not None:
            weight = quantize_loaded(full.detach(), shard, param.quant, param.dtype, env.device)
            release_freed()
            return weight
        tensor = shard.take(full.detach())
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor.to(env.device)

    parallelize(model, layout, env.rank, GroupRef.of(env.group), take)
    model.to(env.device)
    model.autotp = ShardInfo(plan.family, tp, env.rank, _param_bytes(model))
    _finish(model, env, check_inputs)
    return InferenceEngine(model)
