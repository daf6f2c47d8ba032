"""DeepSpeed's inference API where autotp stands in for it: the engine object and the call shapes.

`deepspeed.init_inference(model, mp_size=N)` and `init_inference(model, tensor_parallel={"tp_size": N})`
are how DeepSpeed scripts ask for tensor parallelism; its kernel-injection options mean nothing here and
are accepted and ignored, so such a script runs with one import changed. What the engine does is in
`api.init_inference`; this module only speaks DeepSpeed's language.
"""

from __future__ import annotations

from torch import nn

from autotp.errors import AutotpError

IGNORED = {"replace_with_kernel_inject", "replace_method", "injection_policy", "max_out_tokens",
           "enable_cuda_graph", "checkpoint", "base_dir", "save_mp_checkpoint_path", "min_out_tokens"}


def tp_size(mp_size: int | None, tensor_parallel, options: dict) -> int | None:
    """The tp size a DeepSpeed call asks for (None: as many as launched); unknown options are an error."""
    unknown = set(options) - IGNORED
    if unknown:
        raise AutotpError(f"init_inference got unknown arguments: {', '.join(sorted(unknown))}")
    if tensor_parallel is None:
        return mp_size
    config = tensor_parallel if isinstance(tensor_parallel, dict) else vars(tensor_parallel)
    if mp_size is not None and config.get("tp_size", mp_size) != mp_size:
        raise AutotpError(f"mp_size {mp_size} and tensor_parallel tp_size {config['tp_size']} disagree")
    return config.get("tp_size", mp_size) if config.get("enabled", True) else 1


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
