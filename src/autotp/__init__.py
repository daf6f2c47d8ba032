"""autotp: correct tensor-parallel inference for Hugging Face causal LMs on torch.distributed."""

from autotp.api import InferenceEngine, from_pretrained, init_inference
from autotp.errors import AutotpError

__all__ = ["AutotpError", "InferenceEngine", "from_pretrained", "init_inference"]
__version__ = "0.1.0"
