"""The library entry points: `from_pretrained` (sliced loading) and `init_inference` (DeepSpeed drop-in).

Both validate everything they can (architecture, tp size against heads, checkpoint keys and shapes)
before any weight is read, then hand a model and a `load` callback to `shard.parallelize`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig

from autotp import distributed
from autotp.errors import AutotpError
from autotp.guard import InputGuard
from autotp.hub import resolve_model_dir
from autotp.loader import Checkpoint
from autotp.plans import Plan, plan_for
from autotp.shard import parallelize, parameter_names
from autotp.skeleton import skeleton

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


def load_config(model_dir: Path):
    """config.json as a transformers config; one that is no JSON object, or that transformers rejects (its
    strict fields, e.g. a string for n_layer), is an AutotpError naming the file."""
    path = model_dir / "config.json"
    if not path.exists():
        raise AutotpError(f"no config.json in {model_dir}")
    try:
        fields = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise AutotpError(f"cannot read {path}: {e}") from None
    if not isinstance(fields, dict):
        raise AutotpError(f"{path} is a JSON {type(fields).__name__}, not an object of config fields")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError, StrictDataclassError) as e:
        raise AutotpError(f"cannot read {path}: {' '.join(str(e).split())}") from None


def checkpoint_keys(ckpt: Checkpoint, net: nn.Module, plan: Plan) -> dict[str, str]:
    """Validate the checkpoint against the model skeleton (missing, unused, mis-shaped, mis-typed tensors) before any
    weight is read; each parameter's first name -> its checkpoint key."""
    aliases = {first: names + [plan.checkpoint_names[n] for n in names if n in plan.checkpoint_names]
               for first, names in parameter_names(net).items()}
    params = {first: net.get_parameter(first) for first in aliases}
    return ckpt.validate(aliases, params, getattr(net, "_keys_to_ignore_on_load_unexpected", None) or [])


def _check_tp(tp: int | None, world: int) -> int:
    if tp is None:
        return world
    if tp != world:
        raise AutotpError(f"tp_size {tp} does not match the {world} launched processes (WORLD_SIZE): "
                          f"launch {tp} processes, e.g. torchrun --nproc-per-node {tp}")
    return tp


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def from_pretrained(model: str | os.PathLike, dtype: str | torch.dtype | None = None, tp_size: int | None = None,
                    device: str | torch.device | None = None, check_inputs: bool = True) -> nn.Module:
    """Load this rank's shard of a safetensors causal LM; every rank reads only its own slices.

    model: a local directory or a hub id (downloaded once per node). dtype: None keeps the checkpoint's
    floating dtype. tp_size: defaults to WORLD_SIZE (must equal it). device: defaults to
    cuda:LOCAL_RANK or cpu. check_inputs: raise when ranks feed different input ids (autotp.guard).
    """
    dtype = parse_dtype(dtype)
    env = distributed.init(device)
    tp = _check_tp(tp_size, env.world_size)
    model_dir = resolve_model_dir(model)
    config = load_config(model_dir)
    plan = plan_for(config)
    plan.heads(tp)  # tp vs heads, before anything is read
    ckpt = Checkpoint(model_dir)
    dtype = dtype or ckpt.floating_dtype() or torch.float32
    net = skeleton(config, dtype)
    keys = checkpoint_keys(ckpt, net, plan)
    first = {name: names[0] for names in parameter_names(net).values() for name in names}
    progress = tqdm(total=len(keys), desc=f"loading {plan.family} tp={tp}", unit="tensor",
                    disable=env.rank != 0 or not sys.stderr.isatty())

    def load(names, shard, meta):
        tensor = ckpt.read(keys[first[names[0]]], shard, dtype if meta.is_floating_point() else None)
        progress.update()
        return tensor.to(env.device)

    parallelize(net, plan, env.rank, tp, env.group, load)
    progress.close()
    net.to(env.device)
    net.autotp = ShardInfo(plan.family, tp, env.rank, _param_bytes(net), ckpt.bytes_read)
    _finish(net, env, check_inputs)
    return net


def _finish(model: nn.Module, env: distributed.Dist, check_inputs: bool) -> None:
    """What every sharded model gets last: rank 0's random state on every rank (so a user's own
    unseeded sampling agrees), and the guard against ranks that feed different inputs anyway."""
    distributed.sync_random_state(env)
    if check_inputs and env.group is not None:
        model.register_forward_pre_hook(InputGuard(env.group, env.device), with_kwargs=True)


class InferenceEngine(nn.Module):
    """What `init_inference` returns, like DeepSpeed's engine: an nn.Module whose forward is the model's and
    whose attribute reads fall through to it, so `engine.module`, `engine(ids)`, `engine.generate(...)`,
    `engine.config`, `engine.device` and DeepSpeed's tutorial `pipe.model = init_inference(pipe.model, ...)`
    all work."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.module.generate(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (`module`)
        except AttributeError:
            return getattr(self._modules["module"], name)


DEEPSPEED_IGNORED = {"replace_with_kernel_inject", "replace_method", "injection_policy", "max_out_tokens",
                     "enable_cuda_graph", "checkpoint", "base_dir", "save_mp_checkpoint_path", "min_out_tokens"}


def init_inference(model: nn.Module, mp_size: int | None = None, tensor_parallel=None,
                   dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
                   check_inputs: bool = True, **kwargs) -> InferenceEngine:
    """Shard an already-loaded HF model in place, DeepSpeed-style.

    Accepts DeepSpeed's call shapes: `init_inference(model, mp_size=4)` and
    `init_inference(model, tensor_parallel={"enabled": True, "tp_size": 4})`. Each planned weight is
    sliced and the full one dropped module by module; DeepSpeed kernel-injection options are ignored.
    """
    unknown = set(kwargs) - DEEPSPEED_IGNORED
    if unknown:
        raise AutotpError(f"init_inference got unknown arguments: {', '.join(sorted(unknown))}")
    if tensor_parallel is not None:
        tp_cfg = tensor_parallel if isinstance(tensor_parallel, dict) else vars(tensor_parallel)
        if mp_size is not None and tp_cfg.get("tp_size", mp_size) != mp_size:
            raise AutotpError(f"mp_size {mp_size} and tensor_parallel tp_size {tp_cfg['tp_size']} disagree")
        mp_size = tp_cfg.get("tp_size", mp_size) if tp_cfg.get("enabled", True) else 1
    dtype = parse_dtype(dtype)
    env = distributed.init(device)
    tp = _check_tp(mp_size, env.world_size)
    plan: Plan = plan_for(model.config)

    def load(names, shard, old):
        tensor = shard.take(old.detach())
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor.to(env.device)

    parallelize(model, plan, env.rank, tp, env.group, load)
    model.to(env.device)
    model.autotp = ShardInfo(plan.family, tp, env.rank, _param_bytes(model))
    _finish(model, env, check_inputs)
    return InferenceEngine(model)
