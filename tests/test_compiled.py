"""The compiled decode step (`autotp serve --compile`, serve/compiled.py; `autotp generate --compile`): the
tokens eager gets, on the graph and not beside it, sharded, and a compiler that fails costs a warning, not
the server or the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from checkpoints import word_tokenizer
from engine_driver import ROOMY, drive, engine_for, job, tokens_of
from families import any_model
from pool import free_port
from serve_harness import Server

from autotp.generate import generate
from autotp.serve.runner.compiled import bucket, decode_meta
from autotp.serve.runner.kv_cache import KvPool

DEMO = str(__import__("pathlib").Path(__import__("autotp").__file__).parent / "demo_model")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return word_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _jobs() -> dict[int, list]:
    """Rows that join at different steps, so the decode batch takes 1, 2, 3 (bucket 4) and back: greedy with
    log-probabilities, seeded with top-p, and greedy again."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (5, 9, 3)]
    return {0: [job(prompts[0], 30, index=0, logprobs=2)], 4: [job(prompts[1], 20, 0.8, seed=7, top_p=0.9, index=1)],
            9: [job(prompts[2], 12, index=2)]}


class EagerForwards:
    """Counts the model's forwards that ran as Python (every eager one; a graph's run calls no hook)."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if not torch.compiler.is_compiling():
            self.count += 1


def test_padding_rows_write_the_scratch_slot_and_read_only_the_zero_slot():
    pool = KvPool([(1, 4, torch.float32)], num_blocks=8, block_size=4, device=torch.device("cpu"))
    meta, rows, ids, _ = decode_meta(pool, [[3, 5], [6], [1, 2, 7]], [5, 2, 9], "cpu", [11, 12, 13])
    assert [bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8] and rows == 4
    assert ids.tolist() == [[11, 12, 13, 0]]
    group, = meta.attention.groups
    assert group.slots.shape == (4, 16)  # 9 // 4 = block 2: four blocks of 4, a power of two
    assert meta.slot_mapping.tolist() == [5 * 4 + 1, 6 * 4 + 2, 7 * 4 + 1, pool.scratch]
    assert group.slots[0, :6].tolist() == [12, 13, 14, 15, 20, 21]
    assert group.visible[:, 0, 0].sum(1).tolist() == [6, 3, 10, 1]
    assert (group.slots[~group.visible[:, 0, 0]] == pool.slots).all()
    assert group.slots[3, 0] == pool.slots  # the padding row's one visible slot: zeros
    assert meta.positions.tolist() == [5, 2, 9, 0]


@pytest.mark.slow  # a cold compile: 20-35 s on 2 cores
@pytest.mark.parametrize("name", ["gpt_bigcode_mqa12", "mistral", "falcon_alibi"])
def test_the_compiled_step_gets_the_eager_tokens_and_runs_every_decode_step(name, tokenizer):
    """StarCoder's multi-query layout, a sliding window of 4, and Falcon's ALiBi (whose forward reads the step's
    width from the cache: a shape, or every new width would run eager): greedy tokens equal eager's and HF
    generate's, log-probabilities within 1e-4 (the compiler reorders sums), the seeded row's tokens equal.
    Only the prefill steps run the model's Python: every decode step, at 1, 2 and 3 rows, took the graph."""
    model = any_model(name)
    ended = {}
    for compiled in (False, True):
        engine = engine_for(model, tokenizer, limits=ROOMY)
        if compiled:
            assert engine.executor.runner.compile() > 0
            engine.executor.runner.use_graph()
            eager = EagerForwards(model)
        arrivals = _jobs()
        drive(engine, arrivals)
        ended[compiled] = [j.ended for js in arrivals.values() for j in js]
    assert eager.count <= 4, f"{eager.count} forwards ran eager; only the 3 prefills should"
    for c, e in zip(ended[True], ended[False], strict=True):
        assert tokens_of(c) == tokens_of(e)
    for c, e in zip(ended[True][0].result.logprobs, ended[False][0].result.logprobs, strict=True):
        assert c.logprob == pytest.approx(e.logprob, abs=1e-4)
    prompt = list(_jobs()[0][0].row.ids)
    assert tokens_of(ended[True][0]) == generate(model, torch.tensor([prompt]), max_new_tokens=30)[0, 5:].tolist()


@pytest.mark.slow  # a cold compile on each of 2 ranks
def test_a_client_of_a_compiled_server_gets_the_unsharded_text(tmp_path):
    """`autotp serve --compile` at tp 2 on the demo model (StarCoder's multi-query layout) through the openai
    client: rank 0 reports the warm-up; greedy text, whole or streamed, is the unsharded model's; and two
    seeded prompts in one request (decode steps of 2 rows through the sharded graph, whose all-reduces are
    autotp's shared-memory ops) get the unsharded eager engine's texts for their seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32), AutoTokenizer.from_pretrained(DEMO)
    prompt = "def print_hello_world():"
    ids = tok(prompt).input_ids
    seeded = [tok(p).input_ids for p in ("class Point:", "import os\n\ndef list_files(path):")]
    alone = [job(p, 16, 0.8, seed=9, top_p=0.9, index=i) for i, p in enumerate(seeded)]
    drive(engine_for(model.eval(), tok), {0: alone})
    server = Server(DEMO, tmp_path / "server.log", "--compile", "--dtype", "float32", "--speculate", "0")
    try:
        assert "compiled the decode step in" in server.text()
        answer = server.client.completions.create(model=server.model_id, prompt=prompt, max_tokens=40, temperature=0)
        want = generate(model, torch.tensor([ids]), max_new_tokens=40)[0, len(ids):].tolist()
        assert answer.choices[0].text == tok.decode(want, skip_special_tokens=True)
        stream = server.client.completions.create(model=server.model_id, prompt=prompt, max_tokens=40, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == answer.choices[0].text
        both = server.client.completions.create(model=server.model_id, prompt=seeded, max_tokens=16, temperature=0.8,
                                                top_p=0.9, seed=9)  # one seed per prompt: 9 for both
        assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [
            tok.decode(tokens_of(j.ended), skip_special_tokens=True) for j in alone]
    finally:
        server.kill()


def _generate(tp: int, model_dir, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
           str(free_port()), "-m", "autotp", "generate", "--model", str(model_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# a cold compile on each of 2 ranks; without a compiler, one launch (autotp.compiler answers before tracing)
@pytest.mark.parametrize("no_compiler", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["compiled", "no-compiler"])
def test_generate_compile_at_tp2_prints_the_unsharded_tokens(tmp_path, no_compiler):
    """`torchrun --nproc-per-node 2 -m autotp generate --compile` on StarCoder's layout: rank 0 says the step
    compiled (or, without a C++ compiler, one warning that it runs eager), and the tokens are HF's unsharded."""
    model = any_model("gpt_bigcode_mqa12")
    model.save_pretrained(tmp_path / "model")
    prompt = [3, 17, 42, 8, 99, 51, 23]
    env = {"CXX": "/nonexistent/c++", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")} if no_compiler else None
    out = _generate(2, tmp_path / "model", "--input-ids", ",".join(map(str, prompt)), "--max-new-tokens", "20",
                    "--compile", "--json", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "decode step" in line]
    assert len(said) == 1 and ("did not compile" in said[0]) == no_compiler, out.stderr[-3000:]
    want = generate(model, torch.tensor([prompt]), max_new_tokens=20)[0].tolist()
    assert json.loads(out.stdout)["output_ids"] == [want]


FAILING_CXX = """#!/bin/sh
[ "$1" = "--version" ] && { echo "c++ 1.0"; exit 0; }
echo "c++: internal compiler error" >&2
exit 1
"""


def test_a_compiler_that_fails_to_build_costs_generate_one_warning(tmp_path, capsys):
    """A C++ compiler that answers --version (autotp.compiler finds it) and fails every build: inductor raises
    mid-compile, after tracing, and generate says so in one line and runs eager, with eager's tokens."""
    cxx = tmp_path / "c++"
    cxx.write_text(FAILING_CXX)
    cxx.chmod(0o755)
    torch._dynamo.reset()  # no graph this process made earlier of the same forward may serve
    model, prompt = any_model("gpt_bigcode_mqa12"), torch.tensor([[3, 17, 42, 8, 99]])
    # not monkeypatch: setattr on inductor's config proxy deletes the option when undone
    with torch._inductor.config.patch({"cpp.cxx": (str(cxx),), "fx_graph_cache": False}):  # nor a cached one
        out = generate(model, prompt, max_new_tokens=12, compile=True)
    said = [line for line in capsys.readouterr().err.splitlines() if "decode step" in line]
    assert len(said) == 1 and "did not compile" in said[0] and "CppCompileError" in said[0], said
    assert out.tolist() == generate(model, prompt, max_new_tokens=12).tolist()


def test_a_compile_that_fails_on_a_rank_still_runs_its_warm_up_eager(tokenizer, monkeypatch):
    """serve's warm-up where the graph raises (a compiler that fails mid-build): the warm-up's steps run eager,
    so that the other ranks' collectives are met, then compile() raises what the compiler raised; the engine,
    never given the graph, serves eager's tokens."""
    calls = []

    def failing(forward, **_):
        def graph(ids, meta):
            calls.append(ids.shape[1])
            raise RuntimeError("c++: internal compiler error")

        return graph

    model = any_model("gpt_bigcode_mqa12")
    engine = engine_for(model, tokenizer, limits=ROOMY)
    eager = EagerForwards(model)
    monkeypatch.setattr(torch, "compile", failing)
    with pytest.raises(RuntimeError, match="internal compiler error"):
        engine.executor.runner.compile()
    assert calls == [1] and eager.count == 2  # the graph tried once; both warm-up steps (1 and 2 rows) ran eager
    arrivals = _jobs()
    drive(engine, arrivals)
    prompt = list(arrivals[0][0].row.ids)
    assert tokens_of(arrivals[0][0].ended) == generate(model, torch.tensor([prompt]),
                                                            max_new_tokens=30)[0, 5:].tolist()
