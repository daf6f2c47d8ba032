"""The library entry points: `from_pretrained` (sliced loading) and `init_inference` (DeepSpeed drop-in).

Both start from `prepare` (config, plan, dtype, quantization and the resolved layout: architecture, tp
size against heads, checkpoint keys, shapes and dtypes, all checked before any weight is read), then
differ only in the function that produces each rank's tensor: read the slice from the checkpoint, or cut
it from the weight already loaded.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from autotp import deepspeed_compat, distributed
from autotp.deepspeed_compat import InferenceEngine
from autotp.errors import AutotpError
from autotp.hub import resolve_model_dir
from autotp.loading.memory import release_freed
from autotp.parallel.collectives import GroupRef
from autotp.parallel.input_guard import InputGuard
from autotp.parallel.layout import ExpertKeys, Param
from autotp.parallel.shard import parallelize
from autotp.parallel.slices import TensorShard
from autotp.parallel.stage_cut import cut, decoder_layers
from autotp.parallel.stage_io import StageIO
from autotp.parallel.stages import Stages
from autotp.plans import Plan
from autotp.prepare import prepare
from autotp.quant import gptq
from autotp.quant.load import quantize_loaded, quantize_slice
from autotp.quant.weights import INT4_GROUP, QuantizedWeight


@dataclass
class ShardInfo:
    """What autotp did to a model, kept on it as `model.autotp`."""

    family: str
    tp: int
    rank: int
    param_bytes: int  # bytes of the parameters this rank holds (the layout's count: tests check it against the model)
    bytes_read: int = 0  # checkpoint bytes this rank read (0 for init_inference)
    pp: int = 1  # pipeline stages
    stage: int = 0  # this rank's (rank is its rank within the stage)
    layers: range | None = None  # the decoder layers this rank's stage holds (None: every one)
    stages: Stages | None = None  # the whole pipeline (None without one)


def _check_tp(tp: int | None, world: int, pp: int = 1) -> int:
    if pp < 1:
        raise AutotpError(f"pp_size must be at least 1, got {pp}")
    if tp is None:
        if world % pp:
            raise AutotpError(f"pp_size {pp} does not divide the {world} launched processes (WORLD_SIZE) into stages "
                              f"of equal tensor-parallel size")
        return world // pp
    if tp * pp != world:
        stages = f" x pp_size {pp} = {tp * pp}" if pp > 1 else ""
        raise AutotpError(f"tp_size {tp}{stages} does not match the {world} launched processes (WORLD_SIZE): "
                          f"launch {tp * pp} processes, e.g. torchrun --nproc-per-node {tp * pp}")
    return tp


def from_pretrained(model: str | os.PathLike, dtype: str | torch.dtype | None = None, tp_size: int | None = None,
                    device: str | torch.device | None = None, check_inputs: bool = True,
                    quantize: str | None = None, group_size: int = INT4_GROUP, pp_size: int = 1,
                    pp_layers: tuple[int, ...] | None = None) -> nn.Module:
    """Load this rank's shard of a safetensors causal LM; every rank reads only its own slices (of each
    expert's tensor, too, where an MoE checkpoint stores the experts one tensor each, as the hub's do).

    model: a local directory or a hub id (downloaded once per node). dtype: None keeps the checkpoint's
    floating dtype. tp_size: defaults to WORLD_SIZE (must equal it). device: defaults to
    cuda:LOCAL_RANK or cpu. check_inputs: raise when ranks feed different input ids (autotp.parallel.input_guard).
    quantize: "int8" or "int4" (group_size input features per group) stores the linear layers' weights
    quantized, each slice quantized as it is read (autotp.quant.weights). A GPTQ checkpoint (4-bit, its
    config's quantization_config) loads without it: each rank reads its slice of the GPTQ tensors and
    repacks it for the same int4 kernel (autotp.quant.gptq).
    pp_size > 1: this rank's pipeline stage (WORLD_SIZE = tp_size x pp_size; stage s is ranks s * tp_size onwards),
    its layers split as pp_layers says or evenly (autotp.parallel.stages): it reads only its stage's layers of its
    slice, and its forward is autotp serve's engine's (autotp.parallel.stage_io), not a user's.
    """
    world = distributed.init(device)
    tp = _check_tp(tp_size, world.world_size, pp_size)
    p = prepare(tp, world.device.type, model_dir=resolve_model_dir(model), dtype=dtype, quantize=quantize,
                group_size=group_size)  # all checked before reading
    stages, stage, layout = None, 0, p.layout
    if pp_size == 1 and pp_layers is not None:  # one stage, which pp_layers must give every layer (or refused)
        Stages.split(1, tp, len(decoder_layers(p.model, p.plan)), pp_layers)
    if pp_size > 1:
        stages = Stages.split(pp_size, tp, len(decoder_layers(p.model, p.plan)), pp_layers)
        stage = stages.stage(world.rank)
        layout = cut(p.model, p.layout, stages, stage)
    env = distributed.stage_dist(world, tp, pp_size)
    _announce(p.plan)
    ckpt = p.checkpoint
    what = f"tp={tp}" + (f" pp={pp_size}" if pp_size > 1 else "")
    progress = tqdm(total=len(layout.params), desc=f"loading {p.plan.family} {what}", unit="tensor",
                    disable=world.rank != 0 or not sys.stderr.isatty())

    def read(param: Param, shard: TensorShard, meta: nn.Parameter) -> torch.Tensor | QuantizedWeight:
        progress.update()
        if param.gptq:
            weight = gptq.load_slice(ckpt, param.gptq[env.rank], param.dtype, env.device)
            release_freed()
            return weight
        if param.quant is not None:
            weight = quantize_slice(lambda rows: ckpt.row_blocks(param.key, shard, param.dtype, rows), param.quant,
                                    param.local_shape(env.rank), param.dtype, env.device,
                                    lambda row_max: distributed.all_reduce_max(row_max, env))
            release_freed()  # the slice's temporaries, before the next tensor's (autotp.loading.memory)
            return weight
        if isinstance(param.key, ExpertKeys):
            local = ckpt.assemble(param.local_shape(env.rank), param.key.reads(shard), param.dtype)
        else:
            local = ckpt.read(param.key, shard, param.dtype)
        return local.to(env.device)

    net = p.model
    parallelize(net, layout, env.rank, GroupRef.of(env.group), read)
    progress.close()
    net.to(env.device)
    net.autotp = ShardInfo(p.plan.family, tp, env.rank, layout.rank_bytes(env.rank), ckpt.bytes_read, pp_size, stage,
                           stages and stages.span(stage), stages)
    if stages is not None:  # the engine feeds each stage; a user's generate cannot
        net.autotp_stage = StageIO(net, decoder_layers(net, p.plan), stages.span(stage), stage, pp_size)
        return net
    _finish(net, env, check_inputs)
    return net


def _announce(plan: Plan) -> None:
    """An inferred plan is announced on rank 0, with how to see or refuse it."""
    if plan.source == "inferred":
        distributed.print0(f"autotp: no built-in plan for {plan.family}: using one inferred from its modules "
                           "(`autotp plan --model DIR --tp N` prints it; AUTOTP_INFERRED_PLANS=0 refuses it)",
                           file=sys.stderr)


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
    env = distributed.init(device)
    tp = _check_tp(mp_size, env.world_size)
    p = prepare(tp, env.device.type, model=model, dtype=dtype, quantize=quantize, group_size=group_size)
    _announce(p.plan)

    def take(param: Param, shard: TensorShard, full: nn.Parameter) -> torch.Tensor | QuantizedWeight:
        if param.quant is not None:
            weight = quantize_loaded(full.detach(), shard, param.quant, param.dtype, env.device)
            release_freed()
            return weight
        tensor = shard.take(full.detach())
        if tensor.is_floating_point():
            tensor = tensor.to(param.dtype)
        return tensor.to(env.device)

    parallelize(model, p.layout, env.rank, GroupRef.of(env.group), take)
    model.to(env.device)
    model.autotp = ShardInfo(p.plan.family, tp, env.rank, p.layout.rank_bytes(env.rank))
    _finish(model, env, check_inputs)
    return InferenceEngine(model)
