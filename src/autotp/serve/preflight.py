"""What `autotp serve` refuses before it loads anything: an attention backend this device cannot run (one that
runs on CUDA alone asked for with `--device cpu`: from the flags, before torch is imported), a port it cannot
listen on, a model or tokenizer directory that is not there.

The command line asks `check` before it imports the server (transformers' model code, FastAPI, uvicorn) and, with
`--tp N`, before it starts a rank, so each of these mistakes is one line within a second or two of the command,
not after every rank has imported the server and met the others. server.py checks the same things again where it
uses them (a port can be taken between the two): this module makes a refusal early, never a start-up different.
Each check calls the rule's owner (the attention backends' table, model_dir, Checkpoint, load_tokenizer) rather
than a copy of it; `listen` is the one bind, here and in server.py.

Not here: a hub id (it is checked where it is fetched), and flags that contradict one another whatever the machine
(options.py).
"""

from __future__ import annotations

import os
import socket

from autotp.errors import AutotpError
from autotp.model_dir import config_fields, local_dir
from autotp.serve.options import ServeOptions

# what server.py says where no tokenizer loads
NO_TOKENIZER = "autotp serve needs a tokenizer, and none loads from {source} ({cause}): give --tokenizer"
# files a tokenizer is made from (tokenizer.json, tokenizer_config.json, vocab.json + merges.txt, vocab.txt,
# SentencePiece's tokenizer.model / spiece.model, tiktoken files): a directory with none of them is asked of the
# tokenizer loader at once, which refuses it in server.py's words; one with any of them is left to server.py
TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken")
# backends that run on CUDA alone, and whose kernel it is: `--device cpu` asking for one is refused from the flags,
# before torch is imported (runner/attention/varlen.Varlen.refuse says the same once it is; tests/test_preflight.py
# holds the two to one another)
CUDA_ONLY = {"varlen": "FlashAttention-2"}


def check(opts: ServeOptions, model: str, starts_ranks: bool = False) -> None:
    """Raise server.py's AutotpError for what needs no model, in server.py's order. model: --model, a directory
    or hub id; starts_ranks: this process is `--tp N`'s launcher, whose ranks run `check` again."""
    _attention(opts, starts_ranks)
    if _binds_alone():
        _port(opts.host, opts.port)
    model_dir = local_dir(model, "--model")
    if model_dir is not None:
        config_fields(model_dir)
        from autotp.loading.checkpoint import Checkpoint

        Checkpoint(model_dir)  # the weights before the tokenizer, as server.py: examples/starcoder lacks both
    tokenizer_dir = local_dir(opts.tokenizer, "--tokenizer") if opts.tokenizer else model_dir
    if tokenizer_dir is not None and not any(any(tokenizer_dir.glob(p)) for p in TOKENIZER_FILES):
        from autotp.tokenizer import load_tokenizer

        load_tokenizer(str(tokenizer_dir), missing=NO_TOKENIZER)


def _binds_alone() -> bool:
    """Whether this process may ask for the port: it is the one that binds it (rank 0), or the launcher before it
    starts the ranks, and a refusal here strands no peer. Alone, or under an elastic agent (torchrun, --tp N), which
    stops the other ranks once rank 0 exits; under a launcher without one (the `deepspeed` launcher's environment,
    ranks started by hand) the other ranks would wait for rank 0 at the rendezvous, so the port is left to
    server.py, whose refusal every rank hears."""
    if os.environ.get("RANK", "0") != "0":
        return False
    return int(os.environ.get("WORLD_SIZE", "1")) == 1 or "TORCHELASTIC_RUN_ID" in os.environ


def _attention(opts: ServeOptions, starts_ranks: bool) -> None:
    """The backend's own refusals (runner/attention/backends.choose) on the device this rank will run on."""
    if opts.attention == "sdpa":  # runs everywhere: no device to look at
        return
    if opts.device == "cpu" and opts.attention in CUDA_ONLY:  # the flags alone decide: no torch to import
        raise AutotpError(f"--attention {opts.attention} runs on CUDA only ({CUDA_ONLY[opts.attention]}), not on cpu: "
                          f"use --attention sdpa")
    from autotp.distributed import resolve_device

    device = resolve_device(opts.device, int(os.environ.get("LOCAL_RANK", "0")))
    if starts_ranks and device.type == "cuda":
        # the GPU's capability is the ranks' to ask: a CUDA query here could hold a context on GPU 0 in the
        # launcher for as long as the server runs
        return
    from autotp.serve.runner.attention.backends import choose

    choose(opts.attention, device, opts.block_size)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one): the server's, bound before the model loads so a busy port fails
    fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def refusal(host: str, port: int, e: OSError) -> AutotpError:
    return AutotpError(f"cannot listen on {host}:{port}: {e.strerror or e}")


def _port(host: str, port: int) -> None:
    """Bind as the server does, and let go at once. The bind that serves stays the one server.py makes: a socket
    held here until then would be a second owner of the port, so this process closes it before any rank starts (a
    closed listening socket that accepted nothing leaves no TIME_WAIT, and create_server sets SO_REUSEADDR), and
    only the process that binds, or the launcher before it starts the ranks, asks: under torchrun, ranks probing
    the same port at once would refuse one another, or rank 0's real bind."""
    try:
        listen(host, port).close()
    except OSError as e:
        raise refusal(host, port, e) from None

