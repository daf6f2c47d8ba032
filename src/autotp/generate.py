"""Generation on a sharded model: checks on the prompt, seeding, padding, streaming.

HF's `generate` runs unchanged on every rank. The logits are gathered, so every rank sees the same
numbers; seeding every rank's generator with the same seed (drawn on rank 0 and broadcast when the user
gave none) makes sampled tokens agree too.
"""

from __future__ import annotations

import random
import sys
import time

import torch
import torch.distributed as dist
from transformers import CompileConfig, LogitsProcessorList, StoppingCriteria, TextStreamer

from autotp import compiler, distributed
from autotp.context import context_limit
from autotp.errors import AutotpError, one_line
from autotp.sampling.rules import SamplingParams
from autotp.sampling.sampler import SamplerProcessor


def pad_token_id(generation_config) -> int:
    """The id `generate` and `autotp serve` pad with: the model's pad token, else its first eos id, else 0.
    The first eos id is what HF picks itself when it fills the pad in; 0 only where the model has neither
    (serve's left padding needs some id, and padded positions are masked)."""
    pad, eos = generation_config.pad_token_id, generation_config.eos_token_id
    if pad is not None:
        return pad
    if isinstance(eos, list):
        return eos[0] if eos else 0
    return 0 if eos is None else eos


def check_length(limit: int | None, source: str, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens within `context_limit`'s (limit, source); no check when limit is None."""
    if max_new_tokens < 1:
        raise AutotpError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise AutotpError(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceeds the model's "
                          f"context of {limit} positions ({source})")


def check_ids(config, input_ids: torch.Tensor) -> None:
    """Prompt ids must index the vocabulary. The vocabulary-parallel embedding gives an id outside every
    rank's rows a zero vector instead of failing, so an id past the end would generate text silently."""
    vocab = config.vocab_size
    outside = input_ids[(input_ids < 0) | (input_ids >= vocab)]
    if outside.numel():
        raise AutotpError(f"token id {outside[0].item()} is outside the model's vocabulary of {vocab} ids "
                          f"(0 to {vocab - 1})")


def shared_seed(seed: int | None) -> int:
    """`seed`, or one drawn on rank 0 and broadcast, so that all ranks sample alike."""
    if seed is not None:
        return seed
    box = [random.SystemRandom().randrange(2**31)]
    if distributed.world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def generate(model, input_ids: torch.Tensor, *, max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, num_beams: int = 1,
             seed: int | None = None, tokenizer=None, stream: bool = False,
             max_model_len: int | None = None, compile: bool = False) -> torch.Tensor:
    """prompt ids (batch, prompt_len) -> (batch, prompt_len + new) on every rank; streams on rank 0.
    The prompt and the new tokens must fit `context_limit(model.config, tokenizer, max_model_len)`.

    Sampling draws through autotp/sampling/sampler.py, the server's sampler: each row with its own generator seeded
    with `seed` (drawn on rank 0 and shared when None), so the same prompt, parameters and seed give the
    text `autotp serve` gives. HF's own sampling defaults in the model's generation_config do not apply.

    compile: decode steps through one compiled graph (HF's static cache and `torch.compile`), compiled by a
    warm-up before the first token is streamed; where the compiler fails, eager, after one warning line."""
    check_length(*context_limit(model.config, tokenizer, max_model_len), input_ids.shape[-1], max_new_tokens)
    check_ids(model.config, input_ids)
    seed = shared_seed(seed)
    torch.manual_seed(seed)  # beam search and anything else in HF that draws
    rank = distributed.rank()
    streamer = (TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
                if stream and tokenizer is not None and rank == 0 else None)
    processors = LogitsProcessorList()
    if do_sample:  # HF runs greedy over the sampler's one-hot scores
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        processors.append(SamplerProcessor(params, input_ids.shape[0], model.device))
    args = dict(inputs=input_ids.to(model.device), attention_mask=torch.ones_like(input_ids).to(model.device),
                pad_token_id=pad_token_id(model.generation_config), do_sample=False, num_beams=num_beams,
                max_new_tokens=max_new_tokens, logits_processor=processors)
    if compile:
        args |= _compiled(model, args)
    with torch.inference_mode():
        return model.generate(**args, streamer=streamer)


class _Tokens(StoppingCriteria):
    """Stops every row once it has `n` tokens."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, device=input_ids.device)


def _compiled(model, args: dict) -> dict:
    """model.generate's arguments for compiled decode steps, compiled now by a warm-up of two tokens with the
    same shapes (its first decode step compiles the graph); {} where the compiler failed, said in one line.
    Every rank compiles at once: the graph's collectives run (parallel/collectives.py)."""
    cuda = model.device.type == "cuda"
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True  # HF compiles on GPUs only unless told (its own flag for CPU)
    extra = dict(cache_implementation="static", compile_config=config)
    start, failure = time.perf_counter(), compiler.missing(model.device)
    try:
        with torch.inference_mode():
            # without a compiler the warm-up runs eager: a rank that has one compiles through the same collectives
            model.generate(**args, **({} if failure else extra),
                           stopping_criteria=[_Tokens(args["inputs"].shape[1] + 2)])
    except torch._dynamo.exc.TorchDynamoException as e:
        failure = e
    if failure is not None:
        why = one_line(failure)
    else:  # HF compiles only what it deems compilable (a cache it can compile, no offload, no quantizer saying no)
        why = "" if hasattr(model, "_compiled_call") else "transformers does not compile this model's generate"
    if why:
        distributed.print0(f"autotp: warning: the decode step did not compile, it runs eager ({why})",
                           file=sys.stderr)
        return {}
    distributed.print0(f"autotp: compiled the decode step in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return extra
