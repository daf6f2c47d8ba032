"""The attention backends by name, each an entry that judges itself (vLLM's AttentionBackendEnum): what it refuses
before anything loads (torch, device, block size) and once the probe has seen the model (a bias, soft-capping, the
weights' dtype, the head size), the line start-up says of it, and the step description it builds from the step's
layout, whose `attend` every layer calls. Adding a backend is one module and one entry here.
"""

from __future__ import annotations

import torch

from autotp.errors import AutotpError
from autotp.serve.runner.attention.flex import Flex
from autotp.serve.runner.attention.sdpa import Sdpa
from autotp.serve.runner.attention.varlen import Varlen

BACKENDS = {backend.name: backend for backend in (Sdpa, Flex, Varlen)}  # the first is the default


def choose(name: str, device: torch.device, block_size: int) -> type:
    """The backend `--attention name` asks for, or one line saying why it cannot serve here."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise AutotpError(f"--attention {name} is not a backend: choose one of {', '.join(BACKENDS)}")
    why = backend.refuse(device, block_size)
    if why is not None:
        raise AutotpError(why)
    return backend


def check_model(backend: type, needs: set[str], shapes: list[tuple[int, int, torch.dtype]]) -> None:
    """Raises where the model the probe saw (probe.probe's `needs` and `shapes`) needs what the backend lacks."""
    why = backend.refuse_model(needs, shapes)
    if why is not None:
        raise AutotpError(why)
