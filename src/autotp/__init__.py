"""autotp: correct tensor-parallel inference for Hugging Face causal LMs on torch.distributed.

The entry points live in `autotp.sharded`, which imports torch and transformers; they are imported on
first use (PEP 562 module `__getattr__`), so `import autotp` and the CLI's `--help` and flag errors
pay for neither.
"""

from autotp.errors import AutotpError

__all__ = ["AutotpError", "InferenceEngine", "from_pretrained", "init_inference"]
__version__ = "0.1.0"

_API = {"InferenceEngine", "from_pretrained", "init_inference"}


def __getattr__(name: str):
    if name in _API:
        from autotp import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module 'autotp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
