"""autotp's CUDA path on a CPU build, under tests/cuda_emulation.py: tensors say cuda:0, CUDA's device rules hold
on every op, NCCL's collectives are gloo's. `autotp generate` at tp 1 and 2 and a stretch of the serve engine
(paged steps, speculation, log-probabilities, sampling) give CPU's tokens, and a CPU tensor let into the CUDA
path is caught (the negative controls), so the emulation cannot go blind. It proves placement, not kernels:
nothing here has run on a GPU (README, "What has run on a GPU")."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

try:
    from cuda_emulation import DeviceMismatch, Emulated, emulated_cuda, unavailable

    WHY = unavailable()
except ImportError as e:  # a private torch module it is built on moved
    WHY = f"torch {torch.__version__} moved what the emulation is built on: {e}"

pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no CUDA emulation: {WHY}")

GENERATE = [
    ["--prompt", "def add(a, b):", "--max-new-tokens", "8"],
    ["--prompt", "def add(a, b):", "--max-new-tokens", "8", "--do-sample", "--seed", "7", "--temperature", "0.8",
     "--top-p", "0.9", "--top-k", "20"],
    ["--prompt", "def add(a, b):", "--max-new-tokens", "6", "--num-beams", "2"],
]
SOURCE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add(a, b):\n"


def generated(argv: list[str], emulate: bool) -> str:
    """`autotp generate ARGV --json` as the CLI runs it, on this rank (the process group is the caller's, kept):
    rank 0's printed JSON, or "" on the other ranks."""
    from autotp.cli import build_parser

    args = build_parser().parse_args(["generate", *argv, "--json"] + ([] if emulate else ["--device", "cpu"]))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), emulated_cuda() if emulate else contextlib.nullcontext():
        assert args.func(args) == 0
    return out.getvalue()


def test_the_rules_refuse_what_cuda_refuses():
    with emulated_cuda() as rules:
        x = torch.ones(3, device="cuda")
        assert isinstance(x, Emulated) and x.is_cuda and x.device == torch.device("cuda", 0)
        assert (x + torch.tensor(2.0)).tolist() == [3.0, 3.0, 3.0]  # a CPU scalar is allowed, as in PyTorch
        assert x[torch.tensor([0, 2])].tolist() == [1.0, 1.0]  # CPU indices too (ATen moves them)
        assert (x.cpu() + torch.ones(3)).device.type == "cpu"
        with pytest.raises(DeviceMismatch, match="found at least two devices, cuda:0 and cpu"):
            x + torch.ones(3)
        with pytest.raises(DeviceMismatch):
            torch.ones(2, 3) @ torch.ones(3, 2, device="cuda")
        with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
            x.numpy()
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.multinomial(x, 1, generator=torch.Generator().manual_seed(0))
        assert torch.multinomial(x, 1, generator=torch.Generator(device="cuda").manual_seed(0)).is_cuda
        before = dict(rules.syncs)
        int(x.sum())
        assert rules.syncs["aten::_local_scalar_dense"] == before.get("aten::_local_scalar_dense", 0) + 1
    assert not torch.cuda.is_available()  # nothing stays patched


def test_generate_at_tp_1_gives_cpus_tokens_on_emulated_cuda():
    for argv in GENERATE:
        assert generated(argv, emulate=True) == generated(argv, emulate=False), argv


def test_a_cpu_tensor_in_the_cuda_forward_is_caught(monkeypatch):
    # the negative control: a tensor made without device= on the way of every token must fail, as on a GPU
    forward = torch.nn.LayerNorm.forward

    def leaky(self, x):
        out = forward(self, x)
        return out + torch.zeros(out.shape[-1])

    monkeypatch.setattr(torch.nn.LayerNorm, "forward", leaky)
    with pytest.raises(DeviceMismatch, match="cuda:0 and cpu"):
        generated(GENERATE[0], emulate=True)
    generated(GENERATE[0], emulate=False)  # the same leak is harmless on CPU: only the rules catch it


def test_generate_at_tp_2_gives_cpus_tokens_on_emulated_cuda(pools):
    argv = GENERATE[1]  # sampled: every rank draws with its own CUDA generator, seeded alike
    cpu = pools(2).run(generated, argv, False, timeout=120)
    assert pools(2).run(generated, argv, True, timeout=120) == cpu and cpu[0] and cpu[1] == ""


def nccl_with_a_cpu_tensor() -> str:
    """A pool task: under the emulation the pool's group is NCCL's stand-in; a CPU tensor in one of its collectives
    must be refused as NCCL refuses it, and an emulated CUDA one carried (through gloo, on its CPU values)."""
    import torch.distributed as dist

    with emulated_cuda():
        assert dist.get_backend() == "nccl"
        x = torch.full((2,), float(dist.get_rank() + 1), device="cuda")
        dist.all_reduce(x)
        assert x.is_cuda and x.tolist() == [3.0, 3.0]
        try:
            dist.all_reduce(torch.ones(2))
        except RuntimeError as e:
            return str(e)
    return "carried"


def test_nccls_stand_in_refuses_a_cpu_tensor(pools):
    # the negative control of the collectives: without it, tp 2 could pass CPU tensors through gloo unseen
    said = "No backend type associated with device type cpu"
    assert [s[:len(said)] for s in pools(2).run(nccl_with_a_cpu_tensor, timeout=60)] == [said, said]


def engine_events(emulate: bool, speculate: int = 4, leak: bool = False) -> list | None:
    """A stretch of `autotp serve`'s engine on the demo model, on this rank: greedy rows with log-probabilities
    (and a prompt's), sampled rows with top-p and top-k, one streamed, a row joining midway, drafts from a prompt
    that repeats itself. Rank 0's end events and streamed texts (None on the others). leak: the first layer's
    key pool is a CPU tensor (a pool made without device=)."""
    from engine_driver import job
    from transformers import AutoTokenizer

    import autotp
    from autotp import distributed
    from autotp.cli import default_model
    from autotp.serve.engine.scheduler import Limits
    from autotp.serve.types import Failed, Finished

    with emulated_cuda() if emulate else contextlib.nullcontext():
        model = autotp.from_pretrained(default_model(), device=None if emulate else "cpu", check_inputs=False)
        assert model.device.type == ("cuda" if emulate else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(default_model())
        prompt = tokenizer(SOURCE).input_ids

        def arrivals() -> dict:
            return {0: [job(prompt, 12, index=0, logprobs=2),
                        job(prompt[:5], 10, temperature=0.8, seed=3, top_p=0.9, index=1, stream=True)],
                    2: [job(prompt, 6, index=2, logprobs=1, prompt_logprobs=True),
                        job([5, 6, 7], 8, temperature=1.0, top_k=5, seed=1, index=3)]}

        from autotp.serve.runner import kv_cache

        if leak:
            made = kv_cache.KvPool.__init__

            def cpu_first_layer(self, *args, **kwargs):
                made(self, *args, **kwargs)
                self.keys[0] = self.keys[0].cpu()

        with pytest.MonkeyPatch.context() as m:
            if leak:
                m.setattr(kv_cache.KvPool, "__init__", cpu_first_layer)
            ended = run(model, tokenizer, arrivals, Limits(16, 2048, 4096), speculate)
    if ended is None:
        return None
    assert distributed.rank() == 0
    done = [e.result for e, _ in ended if isinstance(e, Finished)]
    return [(type(e).__name__, (e.status, e.message) if isinstance(e, Failed) else
             (e.result.text, e.result.tokens, e.result.finish_reason), s) for e, s in ended] \
        + [[(lp.id, lp.logprob) for lp in r.logprobs + r.prompt_logprobs if lp is not None] for r in done]


def same_events(got: list, want: list) -> bool:
    """Tokens, texts and ends equal; log-probabilities within 1e-4: an all-reduce through gloo (NCCL's stand-in)
    sums in another order than CPU's shared-memory one."""
    tokens = len(want) // 2
    return got[:tokens] == want[:tokens] and len(got) == len(want) and all(
        [t for t, _ in g] == [t for t, _ in w] and [x for _, x in g] == pytest.approx([x for _, x in w], abs=1e-4)
        for g, w in zip(got[tokens:], want[tokens:], strict=True))


def run(model, tokenizer, arrivals, limits, speculate: int) -> list | None:
    """engine_driver's run_on_ranks, or at tp 1 (no process group) its engine in this process."""
    import torch.distributed as dist
    from engine_driver import drive, engine_for

    if dist.is_initialized():
        from engine_driver import run_on_ranks

        return run_on_ranks(model, tokenizer, arrivals, limits, speculate=speculate)
    engine, jobs = engine_for(model, tokenizer, limits, block_size=4, speculate=speculate), arrivals()
    with torch.inference_mode():
        drive(engine, jobs)
    return [(j.ended, j.streamed) for js in jobs.values() for j in js]


def test_the_serve_engine_at_tp_1_gives_cpus_tokens_on_emulated_cuda():
    cpu = engine_events(emulate=False)
    assert all(e[0] == "Finished" for e in cpu[:4])
    assert same_events(engine_events(emulate=True), cpu)


def test_a_cpu_kv_pool_is_caught_by_the_engine():
    # the negative control of the engine: the step fails its rows (500), as the same mistake would on a GPU
    events = engine_events(emulate=True, leak=True)
    assert [e[0] for e in events[:4]] == ["Failed"] * 4
    assert "cuda:0 and cpu" in str(events[0][1])


def test_the_serve_engine_at_tp_2_gives_cpus_tokens_on_emulated_cuda(pools):
    cpu = pools(2).run(engine_events, False, timeout=120)
    assert cpu[1] is None and all(e[0] == "Finished" for e in cpu[0][:4])
    cuda = pools(2).run(engine_events, True, timeout=120)
    assert cuda[1] is None and same_events(cuda[0], cpu[0])


def pipeline_events(emulate: bool) -> list | None:
    """The engine through a pipeline of 2 stages of the demo model (one rank each), on this rank: greedy rows with
    log-probabilities, a sampled one, a row joining midway, drafts. Rank 0's end events (None on the other)."""
    from engine_driver import job, run_on_pipeline

    from autotp.cli import default_model
    from autotp.serve.engine.scheduler import Limits
    from autotp.serve.types import Finished

    with emulated_cuda() if emulate else contextlib.nullcontext():
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(default_model())(SOURCE).input_ids

        def arrivals() -> dict:
            return {0: [job(prompt, 12, index=0, logprobs=2), job(prompt[:5], 10, temperature=0.8, seed=3, index=1)],
                    2: [job([5, 6, 7], 8, index=2)]}

        ended = run_on_pipeline(default_model(), default_model(), arrivals, 2, Limits(16, 32, 4096), speculate=4,
                                block_size=16, device="cuda" if emulate else "cpu")
    if ended is None:
        return None
    return [(type(e).__name__, e.result.tokens if isinstance(e, Finished) else e.message,
             [lp.logprob for lp in e.result.logprobs] if isinstance(e, Finished) else []) for e, _ in ended]


def test_a_pipeline_of_two_stages_gives_cpus_tokens_on_emulated_cuda(pools):
    """The hidden states cross between stages through host memory (gloo): the stage that receives them puts them on
    its GPU before its layers read them (a CPU tensor there is what the emulation catches)."""
    cpu = pools(2).run(pipeline_events, False, timeout=120)
    assert cpu[1] is None and [e[0] for e in cpu[0]] == ["Finished"] * 3
    cuda = pools(2).run(pipeline_events, True, timeout=120)
    assert cuda[1] is None and [e[:2] for e in cuda[0]] == [e[:2] for e in cpu[0]]
    assert all(g[2] == pytest.approx(w[2], abs=1e-4) for g, w in zip(cuda[0], cpu[0], strict=True))


def test_int8_takes_its_cuda_branch_and_gives_the_same_arithmetics_tokens(monkeypatch):
    """--quantize int8 on CUDA dequantizes into the matmul (weights.py): its tokens are CPU's when CPU does the
    same arithmetic (the dequantizing path at every row count); the CUDA branch ran (no int8 kernel call)."""
    from autotp.quant import weights

    argv = ["--prompt", "def add(a, b):", "--max-new-tokens", "8", "--quantize", "int8"]
    monkeypatch.setattr(weights, "INT8_DEQUANT_ROWS", 0)
    cpu = generated(argv, emulate=False)
    monkeypatch.setattr(weights, "INT8_DEQUANT_ROWS", 10**9)  # a CPU branch taken on "cuda" would call the kernel
    monkeypatch.setattr(torch, "_weight_int8pack_mm", None)
    assert generated(argv, emulate=True) == cpu


def test_int4_on_an_emulated_older_gpu_is_refused_before_loading():
    from autotp import errors

    argv = ["--prompt", "def add(a, b):", "--max-new-tokens", "8", "--quantize", "int4", "--group-size", "32",
            "--dtype", "bfloat16"]
    with emulated_cuda(capability=(7, 5), name="Tesla T4"), pytest.raises(
            errors.AutotpError, match="needs a GPU of compute capability 8.0 or newer .*; Tesla T4 is 7.5"):
        from autotp.cli import build_parser

        args = build_parser().parse_args(["generate", *argv])
        args.func(args)


def test_a_step_waits_for_the_device_once():
    """A step of the serve engine, greedy and seeded rows (top-k, top-p), with and without log-probabilities, plain
    and verifying drafts, waits for the device once: its tokens, their log-probabilities and the drafts' verdicts read
    back in one host sync (it was 2 + 2 per sampled row, then one per drafted row and one more for
    log-probabilities), counted as the emulation sees them: every .tolist(), .item() and copy to the host of a cuda
    tensor."""
    from engine_driver import drive, engine_for, job
    from transformers import AutoTokenizer

    import autotp
    from autotp.cli import default_model

    with emulated_cuda() as rules:
        model = autotp.from_pretrained(default_model(), check_inputs=False)
        tokenizer = AutoTokenizer.from_pretrained(default_model())
        prompt = tokenizer(SOURCE).input_ids
        plain = [job(prompt[:9], 6, index=0), job(prompt[:7], 6, temperature=0.8, seed=1, index=1, logprobs=2),
                 job(prompt[:8], 6, temperature=1.0, top_k=5, top_p=0.9, seed=2, index=2),
                 job(prompt[:6], 6, temperature=0.5, seed=3, index=3, logprobs=0)]
        drafting = [job(prompt, 16, index=4, logprobs=1), job(prompt, 16, temperature=0.1, seed=4, index=5),
                    job(prompt[:12], 6, index=6, prompt_logprobs=True, logprobs=0)]
        counts, blocking = {}, []
        for speculate, rows in ((0, plain), (4, drafting)):
            engine = engine_for(model, tokenizer, speculate=speculate)
            run, steps = engine.executor.runner.run, []

            def counted(step, run=run, steps=steps):
                before, uploads = sum(rules.syncs.values()), rules.uploads
                result = run(step)
                steps.append((sum(w.draft > 0 for w in step.work), sum(rules.syncs.values()) - before))
                blocking.append(rules.uploads - uploads)
                return result

            engine.executor.runner.run = counted
            with torch.inference_mode():
                drive(engine, {0: rows})
            assert all(r.ended.result.tokens for r in rows)
            counts[speculate] = steps
    assert counts[0] == [(0, 1)] * 6, counts[0]
    assert any(drafted for drafted, _ in counts[4]) and all(syncs == 1 for _, syncs in counts[4]), counts[4]
    # and it writes nothing to the device from the host but its one pinned copy of the step's index arrays (a top-p
    # row once wrote a Python False into a device tensor: a blocking copy per row and step)
    assert blocking == [0] * len(blocking), blocking


def test_the_kv_cache_on_cuda_leaves_the_largest_steps_activations_and_what_is_in_use(capsys):
    """vLLM's --gpu-memory-utilization rule on an emulated 80 GiB GPU with 20 GiB in use after loading and a
    1 GiB activation peak (the emulation's figures): 0.9 x 80 - 20 - 1 = 51 GiB may hold the cache; the demo model
    needs far less for 16 full-context rows, and the start-up line says which rule sized it."""
    from cuda_emulation import MEMORY

    import autotp
    from autotp import distributed
    from autotp.cli import default_model
    from autotp.serve.lockstep.wire import Channel
    from autotp.serve.options import ServeOptions
    from autotp.serve.runner.attention.sdpa import Sdpa
    from autotp.serve.startup import budget

    with emulated_cuda():
        assert budget.free_bytes(torch.device("cuda", 0), 0.9, 2**30) == int(0.9 * MEMORY.total) - (
            MEMORY.total - MEMORY.free) - 2**30 == 51 * 2**30
        assert budget.free_bytes(torch.device("cuda", 0), 0.2, 2**30) == 0  # 16 GiB allowed, 20 GiB in use
        net = autotp.from_pretrained(default_model(), check_inputs=False)
        assert budget.step_peak(net, 64) == MEMORY.peak - MEMORY.peak // 2
        env, channel = distributed.init(), Channel()
        opts = ServeOptions(max_num_seqs=16, max_num_batched_tokens=64)
        cache = budget.size(net, channel, env.rank, env.device, opts, 256, Sdpa)
    assert cache.tokens == 16 * 256
    said = capsys.readouterr().err
    assert "KV cache: 4096 tokens per rank" in said and ("sized by 16 sequences (--max-num-seqs) x 256 tokens of "
                                                         "context, within 90% of the GPU's memory") in said, said


def test_the_steps_host_sync_is_inside_the_watchdogs_window():
    """On CUDA a forward only queues its kernels and collectives; the wait for them must fall between the
    watchdog's begin and end, or a rank that dies mid-step leaves rank 0 waiting outside it for NCCL's timeout."""
    from engine_driver import drive, engine_for, job
    from transformers import AutoTokenizer

    import autotp
    from autotp.cli import default_model

    events: list[str] = []
    with emulated_cuda() as rules:
        model = autotp.from_pretrained(default_model(), check_inputs=False)
        engine = engine_for(model, AutoTokenizer.from_pretrained(default_model()))
        watchdog = engine.executor.watchdog
        begin, end, sync = watchdog.begin, watchdog.end, rules.sync
        watchdog.begin = lambda step: (events.append("begin"), begin(step))[1]
        watchdog.end = lambda: (events.append("end"), end())[1]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(rules, "sync", lambda what: (events.append("sync"), sync(what))[1])
            with torch.inference_mode():
                drive(engine, {0: [job([5, 6, 7], 4)]})
    assert events == ["begin", "sync", "end"] * 4, events


def test_the_gpu_benchmark_runs_its_eager_systems_under_the_emulation(monkeypatch, tmp_path, capsys):
    """benchmarks/gpu_decode.py, prepared to run in one call on a GPU: its eager systems (plain HF, autotp's
    sharded model, the serve engine's paged step under sdpa) on a StarCoder-shaped model shrunk to run here. The
    compiled step and the flex backend need a real GPU (CUDA graphs, flex's compiled kernel: the compiler does not
    take the emulated tensors)."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_decode

    monkeypatch.setattr(gpu_decode, "STARCODER_15B", gpu_decode.STARCODER_15B | dict(
        n_embd=64, n_head=4, n_layer=2, n_inner=256, vocab_size=1000, n_positions=512))
    monkeypatch.setattr(gpu_decode, "copy_bandwidth_gbs", lambda: 100.0)  # 4 GiB of copies on this host otherwise
    monkeypatch.setattr(gpu_decode, "HERE", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gpu_decode.py", "--batch", "1", "2", "--new-tokens", "3", "--runs", "1",
                                      "--prompt-len", "8", "--systems", "hf", "autotp", "engine",
                                      "--attention", "sdpa"])
    monkeypatch.setenv("WORLD_SIZE", "1")  # as gpu_decode sets it, and gone again after the test
    with emulated_cuda():
        gpu_decode.main()
    result = json.loads((tmp_path / "results" / "gpu_decode.json").read_text())
    assert [(r["system"], r["batch"]) for r in result["rows"]] == [
        ("hf", 1), ("hf", 2), ("autotp", 1), ("autotp", 2), ("engine/sdpa", 1), ("engine/sdpa", 2)]
    assert result["device"] == "emulated CUDA device" and "ms/token" in capsys.readouterr().out


def test_the_compiled_decode_steps_description_crosses_to_the_device_in_one_pinned_copy():
    """`--compile`'s decode step: its slots, positions, row index and ids leave the host in one non-blocking copy of
    a pinned buffer (it was three blocking copies per step, each a host wait), and KV copies between blocks too."""
    import numpy as np

    from autotp.serve.runner.compiled import decode_meta
    from autotp.serve.runner.kv_cache import KvPool

    with emulated_cuda() as rules:
        pool = KvPool([(1, 4, torch.float32)], num_blocks=8, block_size=4, device=torch.device("cuda", 0))
        before = rules.uploads
        meta, rows, ids, (extra,) = decode_meta(pool, [[3, 5], [6], [1, 2, 7]], [5, 2, 9], "cuda", [11, 12, 13],
                                                [np.arange(3)])
        pool.copy([(3, 4, 2)])
        assert rules.uploads == before, rules.uploads - before
        assert all(t.device.type == "cuda" for t in (meta.slot_mapping, meta.positions, ids, extra))
        assert ids.tolist() == [[11, 12, 13, 0]] and rows == 4
