"""Command line: `autotp plan` (no processes, no weights), `autotp generate` and `autotp serve`.

Thin by design: argparse, then the library by keyword. `--tp N` on generate and serve starts N local ranks
(autotp.launch); under torchrun or the `deepspeed` launcher each rank runs the command itself. Bad input ends in
one line on stderr and a non-zero exit, printed by rank 0 when every rank fails alike, and by the rank it happened
on otherwise; a bad command line is answered before torch is imported, and what `autotp serve` can refuse without
its model (serve/preflight.py) before the server is imported and before `--tp N` starts a rank.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import traceback

from autotp import early
from autotp.errors import AutotpError, one_line
from autotp.launch import NAMES_EXITS, launch

DTYPE_CHOICES = ["float32", "bfloat16", "float16"]
QUANTIZE_CHOICES = ["int8", "int4"]  # autotp.quant.KINDS, without importing torch for the flags
DEMO_ID = "autotp-demo"
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30,
              "tb": 10**12, "tib": 2**40}  # the name `autotp serve` gives the embedded demo model


def default_model() -> str:
    from importlib.resources import files

    demo = files("autotp") / "demo_model"
    if not (demo / "config.json").is_file():
        raise AutotpError("no --model given and the demo model is not installed with this autotp")
    return str(demo)


SPECULATE = 4  # serve --speculate (ServeOptions.speculate): benchmarks/spec_bench.py gains on prose too
COMPILE = False  # serve --compile: benchmarks/compile_bench.py
ATTENTION = ("sdpa", "flex", "varlen")  # serve --attention: serve/runner/attention/backends.BACKENDS, without torch


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def name_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def id_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_plan(args) -> int:
    from autotp.report import format_report, plan_report

    if args.devices:
        return cmd_fit(args)
    if args.tp is None:
        return command_line_error("autotp plan needs --tp N, or --devices to choose it")
    args.pp = args.pp or 1
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    report = plan_report(args.model or default_model(), args.tp, args.dtype, args.quantize, args.group_size, device,
                         args.pp, args.pp_layers)
    if args.pp == 1:  # the one stage holds every layer (main checked a local config.json; this, a hub id's)
        early.check_stages(1, args.pp_layers, report["ranks"][0]["layers"][1])
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def cmd_fit(args) -> int:
    """plan --devices: the layout autotp.fit chooses, a line per stage, and the command lines that start it."""
    from autotp import fit
    from autotp.early import layer_count
    from autotp.hub import resolve_model_dir
    from autotp.model_dir import config_fields

    model = args.model or default_model()
    fields = config_fields(resolve_model_dir(model, patterns=["config.json"]))
    kv_tokens = args.kv_tokens or fit.parse_context(fields) or fit.KV_TOKENS
    measure = fit.measure(model, args.group_size, args.device or "cuda")
    chosen = fit.fit(args.devices, layer_count(fields) or len(measure(None, None, 1, 1).layers[0]), measure, kv_tokens,
                     args.tp, args.pp, args.pp_layers, args.dtype, args.quantize)
    commands = fit.commands(chosen, model, [len(h) for h in args.devices], args.dtype, args.group_size)
    if args.json:
        print(json.dumps({"model": model, "devices": args.devices, **chosen.as_dict(), "commands": commands}))
    else:
        print("\n".join([f"{model}: " + chosen.lines()[0], *chosen.lines()[1:], "", *commands]))
    return 0


def _tokenizer(args, model_dir):
    """The tokenizer; None where none loads and none is needed (--input-ids on a tokenizer-less checkpoint).
    A --tokenizer hub id is fetched like a model (autotp.hub: once per node, under the hub timeout)."""
    from autotp.hub import TOKENIZER_FILES, resolve_model_dir
    from autotp.tokenizer import load_tokenizer

    needed = args.tokenizer or args.prompt is not None
    missing = "cannot load a tokenizer from {source} ({cause}): give --tokenizer, or the prompt as --input-ids"
    source = resolve_model_dir(args.tokenizer, TOKENIZER_FILES, flag="--tokenizer") if args.tokenizer else model_dir
    return load_tokenizer(str(source), missing if needed else None)


def _sampling(args):
    """The sampling flags, by the rules `autotp serve` applies to requests (autotp/sampling/rules.py)."""
    from autotp.sampling.rules import SamplingError, check_sampling

    try:
        return check_sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              max_tokens=args.max_new_tokens)
    except SamplingError as e:
        flag = "--max-new-tokens" if e.param == "max_tokens" else "--" + e.param.replace("_", "-")
        raise AutotpError(f"{flag} {e.rule}, got {e.value}") from None


def cmd_generate(args) -> int:
    import torch

    import autotp
    from autotp import distributed
    from autotp.context import FROM_TOKENIZER, context_limit, context_line
    from autotp.generate import check_ids, check_length, generate
    from autotp.hub import load_config, resolve_model_dir
    from autotp.loading.checkpoint import Checkpoint
    from autotp.tokenizer import fim_prompt

    if (args.prompt is None) == (args.input_ids is None):
        raise AutotpError("give exactly one of --prompt and --input-ids")
    sampling = _sampling(args)
    if args.pp > 1 and (args.num_beams > 1 or args.compile):
        raise AutotpError(f"{'--num-beams' if args.num_beams > 1 else '--compile'} needs the whole model in each "
                          f"process (HF's generate); with --pp {args.pp} the stages run through autotp's engine")
    distributed.init(args.device)  # first: a hub id is downloaded once per node, the other ranks wait
    model_dir = resolve_model_dir(args.model or default_model(), flag="--model")
    config = load_config(model_dir)  # before AutoTokenizer, which reads config.json too and fails on a bad one
    Checkpoint(model_dir)  # its headers: a config without weights (examples/starcoder) is named so, not as a tokenizer
    tokenizer = _tokenizer(args, model_dir)
    if args.suffix is not None:
        if tokenizer is None or args.prompt is None:
            raise AutotpError("--suffix needs --prompt and a tokenizer")
        text = fim_prompt(tokenizer, args.prompt, args.suffix)
    else:
        text = args.prompt
    ids = torch.tensor([args.input_ids]) if text is None else tokenizer(text, return_tensors="pt").input_ids
    if ids.numel() == 0:
        raise AutotpError("the prompt is empty")
    limit, source = context_limit(config, tokenizer, args.max_model_len)
    if limit is None or source == FROM_TOKENIZER:  # not the config's own limit: say which rule applied
        distributed.print0(context_line(limit, source), file=sys.stderr)
    # generate() checks both again; here they fail before the weights are read
    check_length(limit, source, ids.shape[-1], args.max_new_tokens)
    check_ids(config, ids)

    echo = text is not None and args.prompt is not None and not args.json and args.suffix is None
    do_sample = args.do_sample and sampling.temperature > 0  # below sampling.GREEDY_BELOW: greedy, as served
    # the text streams as it comes, but HF's streamer refuses beam search: beams print their text at the end
    streamed = not args.json and tokenizer is not None and args.num_beams == 1
    if args.pp > 1:  # the stages run through the serving engine (serve/offline.py)
        from autotp.serve import offline

        echoed = not echo  # the prompt goes out with the first piece: a stage that cannot load says so alone

        def show(piece: str) -> None:
            nonlocal echoed
            if not echoed:
                print(args.prompt, end="")
                echoed = True
            print(piece, end="", flush=True)

        new = offline.generate(model_dir, ids[0].tolist(), tokenizer, args.max_new_tokens,
                               sampling.temperature if do_sample else 0.0, sampling.top_p, sampling.top_k, args.seed,
                               args.pp, args.pp_layers, args.dtype, args.device, args.quantize, args.group_size,
                               show if not args.json and tokenizer is not None else None)
        if new is not None and not echoed:  # no piece had text
            show("")
        out = None if new is None else torch.cat([ids, torch.tensor([new])], dim=1)
    else:
        # pp_layers: a hub id's --pp-layers, which main could not check, refused there (sharded.py)
        model = autotp.from_pretrained(model_dir, dtype=args.dtype, device=args.device, quantize=args.quantize,
                                       group_size=args.group_size, pp_layers=args.pp_layers)
        if echo:
            distributed.print0(args.prompt, end="")
        out = generate(model, ids, max_new_tokens=args.max_new_tokens, do_sample=do_sample,
                       temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                       num_beams=args.num_beams, seed=args.seed, tokenizer=tokenizer,
                       stream=streamed, max_model_len=args.max_model_len,
                       compile=args.compile)
    if out is None:  # a rank of a later stage: rank 0 prints
        return 0
    new = out[0, ids.shape[-1]:]
    from autotp.serve.engine.text import added_text  # with the prompt as left context, as the server decodes it

    completion = added_text(tokenizer, ids[0].tolist(), new.tolist()) if tokenizer is not None else None
    if args.json:
        distributed.print0(json.dumps({"output_ids": out.tolist(), "text": completion}))
    elif tokenizer is None:
        distributed.print0(",".join(str(t) for t in out[0].tolist()))
    elif args.pp > 1:  # the engine's pieces streamed: end their line
        distributed.print0()
    elif not streamed:  # HF's streamer ends its own line
        distributed.print0(completion)
    return 0


# flags of other launchers and servers that users type for autotp's: flag -> (whose, autotp's)
OTHER_TOOLS = {
    "--tensor_parallel_size": ("vLLM's Python API", "--tp"), "-tp": ("vLLM", "--tp"),
    "--num-shard": ("text-generation-inference", "--tp"), "--num_shard": ("text-generation-inference", "--tp"),
    "--nproc-per-node": ("torchrun", "--tp"), "--nproc_per_node": ("torchrun", "--tp"),
    "--num-gpus": ("deepspeed", "--tp"), "--num_gpus": ("deepspeed", "--tp"),
    "--mp-size": ("DeepSpeed's init_inference", "--tp"), "--mp_size": ("DeepSpeed's init_inference", "--tp"),
    "--model-id": ("text-generation-inference", "--model"), "--hostname": ("text-generation-inference", "--host"),
    "--max-total-tokens": ("text-generation-inference", "--max-model-len"),
    "--max-batch-prefill-tokens": ("text-generation-inference", "--max-num-batched-tokens"),
    "--max-concurrent-requests": ("text-generation-inference", "--max-queue"),
}


def launcher_world() -> str | None:
    """WORLD_SIZE as a launcher (torchrun, deepspeed, autotp.launch) exported it, or None when run alone."""
    return os.environ.get("WORLD_SIZE")


def command_line_error(message: str) -> int:
    """`autotp: error: MESSAGE` for a bad command line, exit 2. Run alone, said at once, before torch is imported.
    Under a launcher every rank parses the same argv: rank 0 says it, once (distributed.fail; under torchrun the
    others wait for rank 0 to have said it before they exit)."""
    if launcher_world() is not None:
        from autotp import distributed

        return distributed.fail(message, code=2)
    print(f"autotp: error: {message}", file=sys.stderr, flush=True)
    return 2


def other_tool_hint(message: str) -> str:
    """For argparse's "unrecognized arguments: ...": where one is another tool's flag, autotp's for it; for a
    flag typed before the command, the order."""
    if message.startswith("argument command: invalid choice"):  # `autotp --tp 2 serve`
        return " (the command comes first, its flags after it: autotp serve --tp 2)"
    if not message.startswith("unrecognized arguments:"):
        return ""
    for word in message.split()[2:]:
        flag = word.split("=", 1)[0]
        if flag in OTHER_TOOLS:
            tool, ours = OTHER_TOOLS[flag]
            return f" ({flag} is {tool}'s flag; autotp's is {ours})"
    return ""


def flag_hint(message: str, flags: list[str]) -> str:
    """For argparse's "unrecognized arguments: ...": the closest of `flags` to the first unknown flag that has one
    (difflib: `--prot` -> `--port`, `--tensor-parallel` -> `--tensor-parallel-size`)."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    for word in message.split()[2:]:
        close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1) if word.startswith("--") else []
        if close:
            return f" (did you mean {close[0]}?)"
    return ""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line, said once (command_line_error), with a hint where the flag is another
    tool's or a mistyped one of the command's, and exit 2. argparse's own `PROG: error:` prefix is left out: the line
    starts `autotp: error:`. No abbreviations (argparse's allow_abbrev): `--tensor-parallel` is no flag, so that a
    flag added later cannot change what an abbreviation a user's script already types means."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.argv: list[str] = []

    def parse_args(self, args=None, namespace=None):
        # the command line, for error(): which command's flags a mistyped one is near
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def flags(self) -> list[str]:
        """The flags of the command on the command line (this parser's where none is), hidden ones left out."""
        parser = self
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        parser = next((commands[word] for word in self.argv if word in commands), self)
        return [flag for action in parser._actions if action.help != argparse.SUPPRESS
                for flag in action.option_strings]

    def error(self, message: str):
        hint = other_tool_hint(message) or flag_hint(message, self.flags())
        raise SystemExit(command_line_error(message + hint))


def serve_options(args, starts_ranks: bool = False):
    """serve's flags as ServeOptions, after every refusal that needs no model (options.py: flags that contradict
    one another; serve/preflight.py: the backend on this device, the port, the directories)."""
    from autotp.serve import preflight
    from autotp.serve.options import ServeOptions

    key, source = args.api_key, "--api-key"
    if key is None:
        key, source = os.environ.get("AUTOTP_API_KEY"), "AUTOTP_API_KEY"
    if key is not None and not key.strip():
        # what --api-key "$KEY" passes when KEY is unset: serving without a key would be the silent outcome
        raise AutotpError(f"{source} is empty: give a key, or leave it out to serve without one")
    opts = ServeOptions(host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_queue=args.max_queue, max_model_len=args.max_model_len, tokenizer=args.tokenizer,
                        dtype=args.dtype,
                        device=args.device, quantize=args.quantize, group_size=args.group_size,
                        max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout,
                        allowed_hosts=args.allowed_hosts, api_key=key, block_size=args.block_size,
                        prefix_caching=args.prefix_caching, speculate=args.speculate, compile=args.compile,
                        attention=args.attention, pp=args.pp, pp_layers=args.pp_layers)
    opts.check()
    preflight.check(opts, args.model or default_model(), starts_ranks)
    return opts


def cmd_serve(args) -> int:
    from autotp.serve import serve

    return serve(args.model or default_model(), model_id=args.model or DEMO_ID, opts=args.opts)  # main's


def byte_size(text: str) -> int:
    """"2GiB", "512MiB", "1.5GB", "4096" -> bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MiB or a number of bytes, got {text!r}")
    value = int(float(found.group(1)) * SIZE_UNITS[found.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def add_quantize_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                        help="store the linear layers' weights as int8 (per output channel) or int4 (groups)")
    parser.add_argument("--group-size", type=int, choices=[32, 64, 128, 256], default=128,  # quant.INT4_GROUPS
                        help="input features per int4 group (default 128)")


def device_sizes(text: str) -> list[int]:
    """"24GiB,12GiB" -> one host's GPU sizes in bytes; 8G is 8GiB, as GPU memory is counted."""
    return [byte_size(re.sub(r"(?i)([kmgt])$", r"\1iB", t.strip())) for t in text.split(",")]


def add_tp_flag(parser: argparse.ArgumentParser, text: str, starts_ranks: bool = True) -> None:
    parser.add_argument("--tp", "--tensor-parallel-size", type=positive_int, metavar="N", help=text)
    if starts_ranks:  # a command that starts its ranks (autotp.launch)
        parser.add_argument("--master-port", type=port_number, metavar="PORT",
                            help="where the ranks this command starts meet, on 127.0.0.1 (default: $MASTER_PORT, "
                                 "else a free port; torchrun's flag)")


def layer_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, e.g. 18,22, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every stage needs a layer at least, got {text!r}")
    return counts


def add_pp_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", "--pipeline-parallel-size", type=positive_int, default=1, metavar="N",
                        help="pipeline stages, each of --tp ranks holding a run of the decoder layers (default 1). "
                             "Ranks are numbered host by host, stage s being ranks s*tp onwards: across hosts, "
                             "`torchrun --nnodes N --nproc-per-node TP` puts a stage on each, so that only one hidden "
                             "state per token crosses the network")
    parser.add_argument("--pp-layers", type=layer_counts, metavar="A,B,...",
                        help="decoder layers per stage, e.g. 18,22 for GPUs of different sizes (default: as even as "
                             "can be, the first stages taking one more)")


def ranks_asked(args) -> int:
    """The ranks a command runs on: --tp x --pp (1 where neither is given)."""
    return (args.tp or 1) * getattr(args, "pp", 1)


class Version(argparse.Action):
    """--version: autotp's, and the installed torch's and transformers' for a bug report. Read from their metadata
    when asked (65 ms that no other command pays), nothing imported."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the versions of autotp, torch and transformers")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        from autotp import __version__

        def of(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        print(f"autotp {__version__} (torch {of('torch')}, transformers {of('transformers')})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from autotp.environment import epilog

    parser = Parser(prog="autotp", description="Tensor-parallel inference for HF causal LMs.", epilog=epilog(),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=Version)
    sub = parser.add_subparsers(dest="command", required=True)

    # each command's --help lists the environment too: `autotp serve --help` is where a user looks
    commands = dict(epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    plan = sub.add_parser("plan", help="show how each tensor is partitioned across ranks (reads no weights)",
                          **commands)
    plan.add_argument("--model", help="model directory or hub id (default: the embedded demo model)")
    add_tp_flag(plan, "number of tensor-parallel ranks (of each pipeline stage; required without --devices)",
                starts_ranks=False)
    add_pp_flags(plan)
    plan.set_defaults(pp=None)  # --devices chooses it where left out; 1 otherwise
    plan.add_argument("--devices", type=device_sizes, action="append", metavar="SIZE,SIZE,...",
                      help="one host's GPU memory, e.g. 24GiB,12GiB (give it once per host, in node-rank order): "
                           "choose --tp, --pp, --pp-layers and, unless --dtype or --quantize is given, the most "
                           "precise weight form that fits, keeping what is given (counted for CUDA's kernels "
                           "unless --device cpu); prints the command lines")
    plan.add_argument("--kv-tokens", type=positive_int, metavar="N",
                      help="with --devices: tokens the KV cache must hold, context x sequences (default: the model's "
                           "context, one sequence)")
    plan.add_argument("--dtype", choices=DTYPE_CHOICES, help="dtype for byte counts (default: checkpoint/config)")
    add_quantize_flags(plan)
    plan.add_argument("--device", choices=["cpu", "cuda"],
                      help="whose quantized kernels must take each slice (default: cuda if available, else cpu)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.set_defaults(func=cmd_plan)

    tp_text = ("tensor-parallel ranks this command starts on this host (default 1; under torchrun, which starts "
                "the ranks itself, leave it out or give its WORLD_SIZE)")
    gen = sub.add_parser("generate", help="generate text with a sharded model (--tp N ranks)", **commands)
    gen.add_argument("--model", help="model directory or hub id (default: the embedded demo model)")
    add_tp_flag(gen, tp_text)
    add_pp_flags(gen)
    gen.add_argument("--prompt", help="prompt text")
    gen.add_argument("--input-ids", type=id_list, help="prompt as comma-separated token ids (no tokenizer needed)")
    gen.add_argument("--suffix", help="fill in the middle: text after the gap; --prompt is the text before it")
    gen.add_argument("--tokenizer", help="tokenizer directory or hub id (default: the model's)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--max-model-len", type=positive_int,
                     help="prompt + new tokens at most (default: the config's position limit, else the tokenizer's "
                          "model_max_length, else none)")
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding (default: greedy)")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="nucleus sampling: sample among the most likely tokens whose probabilities add up to P "
                          "(default 1.0: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off, "
                                                         "as in the server)")
    gen.add_argument("--num-beams", type=positive_int, default=1, help="beam search width (default 1: no beam search)")
    gen.add_argument("--seed", type=int, help="sampling seed (default: drawn on rank 0, shared)")
    gen.add_argument("--compile", action="store_true",
                     help="decode through one graph compiled by torch.compile first (HF's static cache); pays "
                          "when many tokens follow the compilation; where it fails, eager after a warning")
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, help="weights dtype (default: as stored)")
    add_quantize_flags(gen)
    gen.add_argument("--device", choices=["cpu", "cuda"],
                     help="where the ranks run (default: cuda if available, else cpu)")
    gen.add_argument("--json", action="store_true", help='print {"output_ids": ..., "text": ...} on rank 0')
    # the `deepspeed` launcher appends --local_rank=N; LOCAL_RANK in the environment says the same
    gen.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI- and TGI-compatible completions server (--tp N ranks)", **commands)
    srv.add_argument("--model", help=f"model directory or hub id, also the name clients use (default: the embedded "
                                     f"demo model, named {DEMO_ID})")
    add_tp_flag(srv, tp_text)
    add_pp_flags(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=port_number, default=8000, help="port to listen on; 0 picks a free one "
                                                                    "(default 8000)")
    srv.add_argument("--max-num-seqs", "--max-batch-size", type=positive_int, default=16,
                     help="sequences decoding or prefilling at once (default 16)")
    srv.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                     help="tokens per step: one per decoding sequence plus the prefill chunk (default 2048)")
    srv.add_argument("--kv-cache-memory", type=byte_size,
                     help="KV cache per rank, e.g. 4GiB (default: what --max-num-seqs full-context sequences need, "
                          "at most --gpu-memory-utilization of the GPU's memory less what is in use and the largest "
                          "step's activations, or half the host's available memory, or of a memory cgroup's limit "
                          "less its use where that is less, shared by the host's ranks)")
    srv.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                     help="share of each GPU's total memory this server may hold: weights, activations and KV "
                          "cache (vLLM's flag; default 0.9)")
    srv.add_argument("--block-size", type=positive_int, default=16,
                     help="tokens per KV cache block, the unit of prefix caching (default 16)")
    srv.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                     help="compute every prompt in full instead of reusing the cached blocks of an earlier "
                          "prompt's prefix (default: reused)")
    srv.add_argument("--speculate", type=non_negative_int, default=SPECULATE, metavar="K",
                     help="up to K tokens per decoding sequence and step guessed from its own prompt and output "
                          "(prompt lookup) and verified in the same forward; the text is the same either way "
                          f"(default {SPECULATE}; 0: off)")
    srv.add_argument("--compile", action=argparse.BooleanOptionalAction, default=COMPILE,
                     help="run every decode step (each sequence one token) as one graph compiled by torch.compile "
                          "at start-up; a model the compiler cannot take is served eager, with a warning "
                          f"(default {'on' if COMPILE else 'off'})")
    srv.add_argument("--attention", choices=ATTENTION, default=ATTENTION[0],
                     help="attention backend: sdpa (each row's context gathered from the KV cache, at most two "
                          "scaled_dot_product_attention calls per layer; the default), flex (one flex_attention "
                          "call per layer reading the cache in place; on CPU eager, a slow reference; on CUDA "
                          "compiled, not yet run on a GPU), varlen (CUDA only: one paged FlashAttention-2 call per "
                          "layer, --block-size a multiple of 256, float16 or bfloat16, no ALiBi or soft-capping; "
                          "not yet run on a GPU)")
    srv.add_argument("--max-queue", type=positive_int, default=256,
                     help="prompts waiting for room; past it requests get 429 (default 256)")
    srv.add_argument("--max-model-len", type=positive_int, help="prompt + completion tokens per request "
                                                                "(default: the model's context, as for generate)")
    srv.add_argument("--tokenizer", help="tokenizer directory or hub id (default: the model's)")
    srv.add_argument("--dtype", choices=DTYPE_CHOICES,
                     help="weights dtype (default: as stored, except on CPU a float32 checkpoint in bfloat16 where "
                          "the CPU has native bfloat16 products, AMX or AVX512_BF16, or with --quantize)")
    add_quantize_flags(srv)
    srv.add_argument("--device", choices=["cpu", "cuda"],
                     help="where the ranks run (default: cuda if available, else cpu)")
    srv.add_argument("--max-body-bytes", type=positive_int, default=2**21,
                     help="largest request body; more is refused with 413 (default 2 MiB)")
    srv.add_argument("--read-timeout", type=positive_float, default=30.0,
                     help="seconds a client has to send a request's headers and body (default 30)")
    srv.add_argument("--allowed-hosts", type=name_list,
                     help="Host header names to answer, comma-separated, '*' for any (default: loopback names "
                          "when bound to loopback, else any)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* and TGI's /generate, "
                                       "/generate_stream and / (/health, /info and /metrics stay open; default: "
                                       "$AUTOTP_API_KEY, which, unlike a flag, other users cannot read in the process "
                                       "list)")
    srv.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # as for generate
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    world = launcher_world()
    pp = getattr(args, "pp", 1) or 1  # plan leaves it None for --devices to choose
    if args.command != "plan" and world is not None and args.tp is not None and world != str(ranks_asked(args)):
        asked = f"--tp {args.tp}" + (f" x --pp {pp} = {args.tp * pp}" if pp > 1 else "")
        fits = f"--tp {int(world) // pp}" if int(world) % pp == 0 else "--tp"
        return command_line_error(f"{asked} disagrees with the {world} ranks its launcher started "
                                  f"(WORLD_SIZE={world}): under torchrun give {fits} or leave --tp out")
    if args.command != "plan" and world is not None and args.tp is None and int(world) % pp:
        return command_line_error(f"--pp {pp} does not divide the {world} ranks its launcher started "
                                  f"(WORLD_SIZE={world}) into stages of equal size")
    starts_ranks = args.command != "plan" and world is None and ranks_asked(args) > 1
    # the flags and config.json alone decide these: before torch is imported, before --tp N starts a rank, and on a
    # launcher's ranks before the process group forms (said once, by rank 0), so a refusal costs none of them
    try:
        early.check_model(args.model or default_model(), pp, args.pp_layers)
        if args.command == "serve":
            args.opts = serve_options(args, starts_ranks)
    except (AutotpError, OSError) as e:  # OSError: an unreadable model file or directory
        return command_line_error(str(e) if isinstance(e, AutotpError) else f"{type(e).__name__}: {e}")
    # what is loading, at once (torch's import and the load take seconds to minutes, and a log has no progress bar):
    # said by rank 0, or by the launcher that starts the ranks (not by its rank 0 again)
    launched = NAMES_EXITS in os.environ
    if args.command == "serve" and (starts_ranks or os.environ.get("RANK", "0") == "0" and not launched):
        device = args.device or "cuda if torch sees a GPU, else cpu"
        print(f"autotp serve: loading {args.model or DEMO_ID} (tp={args.tp or int(world or pp) // pp} pp={pp}) on "
              f"{device}", file=sys.stderr, flush=True)
    if starts_ranks:
        # each rank runs this argv again, under WORLD_SIZE = --tp x --pp
        return launch(ranks_asked(args), argv, args.master_port)
    # torch: paid only once the flags are good (--help and flag errors are instant)
    from autotp import distributed, hosts

    if world is not None and args.command != "plan":
        hosts.WATCH.begin()  # another host's failure at start-up ends this rank too, in seconds

    try:
        code = args.func(args)
        if world is not None and args.command != "plan":
            hosts.check_in_for_agent()  # torchrun's other hosts exit in silence, also after a Ctrl-C here
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head`
        return 0
    except Exception as e:  # noqa: BLE001 - one line per failure, the traceback on request
        if isinstance(e, AutotpError):
            message, code = str(e), 2
        else:
            if os.environ.get("AUTOTP_DEBUG"):
                traceback.print_exc()
            message, code = one_line(e, 10**6), 1
        # Bad input fails alike on every rank, whether autotp's checks or transformers notice it: rank 0 says
        # it, and another rank only a failure rank 0 does not share (distributed.fail decides which, through
        # the process group's store)
        gone = distributed.exited_rank(e)
        if gone is not None and os.environ.get(NAMES_EXITS):
            # a peer's process ended mid-collective: autotp's launcher names it (with the signal that killed it,
            # or the peer said its own failure); this rank's line would be the symptom, said first when this
            # rank notices before the launcher stops it
            return code
        return distributed.fail(message, code=code, symptom=distributed.peer_lost(e),
                                rank_0_exited=gone is not None and gone.rank == 0)
    finally:
        distributed.shutdown()


def entry() -> None:
    """`autotp` and `python -m autotp`: run, flush, and leave without the interpreter's teardown.

    main() has destroyed the process groups by then, but a gloo group that something still holds keeps its
    worker threads, and one of those that lets go of a collective's tensor while the interpreter finalizes
    aborts the process (autotp.distributed._destroy_at_exit): `autotp serve`'s engine holds its control
    group to the end. os._exit skips finalization; the output is flushed here first."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
