"""Model skeletons: a Hugging Face model built from its config with no weight memory.

Parameters live on the meta device (shapes and dtypes only) until the sliced loader fills them; buffers
(causal masks, rotary frequencies) are computed for real, because they come from the config and not
from the checkpoint. This is the "params on meta, buffers real" trick that accelerate's
`init_empty_weights(include_buffers=False)` also uses: `torch.empty` of a parameter commits no memory,
and each parameter is moved to meta as it is registered, before HF's init functions touch it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from transformers import AutoModelForCausalLM


@contextmanager
def _parameters_on_meta():
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(config, dtype: torch.dtype, buffers: bool = True) -> nn.Module:
    """The causal LM for `config` with parameters on meta; buffers real unless `buffers=False`
    (then everything is meta: enough to plan, nothing to run)."""
    if buffers:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
