"""`autotp serve`'s settings (`ServeOptions`), and the contradictions among them, refused before anything is
loaded. No torch: the command line asks `check()` before importing the server, so that a refused flag costs no
rank its imports."""

from __future__ import annotations

from dataclasses import dataclass

from autotp.errors import AutotpError

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default: the share of the GPU's total memory this rank may hold


@dataclass(frozen=True)
class ServeOptions:
    """`autotp serve`'s settings, as the flags give them (cli.py)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes per rank; None: from the free memory (startup/budget.py)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION  # vLLM's flag: share of the GPU's memory
    max_queue: int = 256
    max_model_len: int | None = None
    tokenizer: str | None = None  # a directory or hub id; default: the model's
    dtype: str | None = None
    device: str | None = None
    quantize: str | None = None
    group_size: int = 128
    max_body_bytes: int = 2**21
    read_timeout: float = 30.0
    allowed_hosts: list[str] | None = None
    api_key: str | None = None
    block_size: int = 16  # tokens per KV block
    prefix_caching: bool = True
    speculate: int = 4  # prompt-lookup draft tokens per decoding row and step (cli.SPECULATE)
    compile: bool = False  # the decode step as one compiled graph (compiled.py; cli.COMPILE)
    attention: str = "sdpa"  # the attention backend: sdpa, flex or varlen (runner/attention/backends.py)
    pp: int = 1  # pipeline stages (serve/pipeline/): WORLD_SIZE = tp x pp
    pp_layers: tuple[int, ...] | None = None  # decoder layers per stage (--pp-layers); None: as even as can be

    def check(self) -> None:
        """Raise AutotpError for settings that contradict one another, whatever the model."""
        if self.api_key is not None and not self.api_key.strip():
            raise AutotpError("the API key is empty: give a key, or none to serve without one")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise AutotpError(f"--max-num-batched-tokens {self.max_num_batched_tokens} is less than --max-num-seqs "
                              f"{self.max_num_seqs}: every running row decodes one token per step")
        if self.pp > 1 and self.compile:
            raise AutotpError(f"--compile runs the whole model as one graph; with --pp {self.pp} each stage runs part "
                              f"of it: leave out --compile")
        if self.pp_layers is not None and len(self.pp_layers) != self.pp:
            raise AutotpError(f"--pp-layers gives {len(self.pp_layers)} stages "
                              f"({','.join(map(str, self.pp_layers))}) for --pp {self.pp}")
