"""Pipeline parallelism on one host: stages of tensor-parallel ranks, each holding a run of the decoder layers.

The oracle is the engine tests' (rows.py): each row generated alone, unsharded, by HF `generate`. Through a pipeline
of 2 or 3 stages, of 1 or 2 ranks each, every row must get the same tokens, with rows joining mid-way, prompts longer
than a chunk, prefixes from the cache and drafts verified. Which layers and tensors each stage holds is checked on the
resolved layout, before any weight is read.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
from checkpoints import saver, word_tokenizer
from engine_driver import drafted_and_cached, pipeline_failing, pipeline_rows, tokens_of
from families import MODELS, any_model
from rows import LIMITS, SPEC, alone, prompts

from autotp.errors import AutotpError
from autotp.parallel.stage_cut import Passthrough, cut, decoder_layers
from autotp.parallel.stages import Stages
from autotp.prepare import prepare

# the families of the issue: multi-query (StarCoder's), grouped-query with tied embeddings, ALiBi, soft-capping
FAMILIES = ["gpt_bigcode_mqa12", "gemma", "bloom", "gemma2"]
LAYERS = 5  # uneven at pp 2 (3, 2) and pp 3 (2, 2, 1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(name) -> the directory of that model's LAYERS-layer checkpoint, written once for the module."""
    return saver(tmp_path_factory, lambda name: any_model(name, LAYERS))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("words"))


def test_layers_go_to_stages_evenly_the_first_taking_one_more():
    assert Stages.split(2, 2, 30).layers == (15, 15)
    assert Stages.split(3, 1, 40).layers == (14, 13, 13)
    s = Stages.split(2, 2, 40, (18, 22))
    assert (s.span(0), s.span(1)) == (range(0, 18), range(18, 40))
    assert [s.stage(r) for r in range(4)] == [0, 0, 1, 1] and s.sampler == 2
    assert [s.next_rank(r) for r in range(4)] == [2, 3, None, None]
    assert [s.prev_rank(r) for r in range(4)] == [None, None, 0, 1]


@pytest.mark.parametrize("pp, given, words", [
    (41, None, ["--pp 41", "40 decoder layers"]),
    (2, (18, 20), ["18,20", "sum to the model's 40 layers, not 38"]),
    (2, (40, 0), ["40,0", "a layer at least"]),
    (3, (20, 20), ["2 stages", "--pp 3"]),
])
def test_a_split_that_cannot_be_says_both_numbers(pp, given, words):
    with pytest.raises(AutotpError) as e:
        Stages.split(pp, 1, 40, given)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("name", MODELS)
def test_each_stage_reads_its_layers_and_the_embeddings_only_where_used(name, tmp_path):
    """The stage's layout, on the meta skeleton: every decoder layer's tensors on one stage only, the input embedding
    on stage 0, the LM head on the last (a tied one read there as the head's weight)."""
    model = any_model(name, 4)
    model.save_pretrained(tmp_path)
    full = prepare(1, "cpu", model_dir=tmp_path)
    embed = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings()) + ".weight"
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    stages = Stages.split(2, 1, 4)
    held = []
    for stage in range(2):
        p = prepare(1, "cpu", model_dir=tmp_path)
        layout = cut(p.model, p.layout, stages, stage)
        layers = decoder_layers(p.model, p.plan)
        assert [isinstance(m, Passthrough) for m in layers] == [i not in stages.span(stage) for i in range(4)]
        names = {n for n, _ in p.model.named_parameters(remove_duplicate=False)}
        assert {q.name for q in layout.params.values()} == {layout.param(n).name for n in names}
        held.append(names)
        assert (embed in names) == (stage == 0)  # the input embedding: stage 0's
        assert (head in names) == (stage == 1)  # the LM head: the last stage's, tied or not
        if tied and stage == 1:  # the tied weight is read there as the head's
            assert layout.param(head).name == embed
        assert layout.rank_bytes(0) < full.layout.rank_bytes(0)
    every = {n for n, _ in full.model.named_parameters(remove_duplicate=False)}
    assert held[0] | held[1] == every
    in_layers = {n for n in every if ".layers." in n or ".h." in n or ".blocks." in n}
    assert not in_layers & held[0] & held[1], "a decoder layer's tensor on both stages"


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("pp, tp", [(2, 1), (3, 1), (2, 2)])
def test_every_row_gets_the_unsharded_tokens_through_the_pipeline(pools, saved, tokenizer_dir, name, pp, tp):
    ranks = pools(pp * tp).run(pipeline_rows, saved(name), tokenizer_dir, prompts(), SPEC, LIMITS, pp)
    assert ranks[1:] == [None] * (pp * tp - 1)
    assert [tokens_of(e) for e in ranks[0]] == alone(any_model(name, LAYERS))


def test_drafts_cached_prefixes_and_log_probabilities_go_through_the_pipeline(pools, saved, tokenizer_dir):
    import torch

    from autotp.generate import generate

    name = "gpt_bigcode_mqa12"
    results = pools(2).run(drafted_and_cached, saved(name), tokenizer_dir, 2, (4, 1))[0]
    model = any_model(name, LAYERS)
    words = [5, 6, 7, 8, 9, 10, 11, 12] * 3
    for ids, n, result in [(words, 12, results[0]), (words, 12, results[1]), (words[:12] + [40, 41], 8, results[2])]:
        x = torch.tensor([ids])
        assert list(result.tokens) == generate(model, x, max_new_tokens=n)[0, len(ids):].tolist()
    assert results[1].cached_tokens >= 16, "the second prompt's blocks came from the cache"
    with torch.no_grad():
        x = torch.tensor([words + list(results[0].tokens)])
        expected = torch.log_softmax(model(x).logits[0].float(), -1)
    for i, lp in enumerate(results[0].logprobs):
        assert lp.logprob == pytest.approx(expected[len(words) - 1 + i, lp.id].item(), abs=1e-4)


def test_a_chunk_that_fails_on_a_stage_fails_its_row_and_the_rest_go_on(pools, saved, tokenizer_dir):
    """The last stage's forward of a long prompt's second chunk raises (its ranks alike) while the third chunk is
    already in the pipeline: that row gets 500, and the server goes on (rows before and after get their tokens)."""
    import torch

    from autotp.generate import generate

    name = "gpt_bigcode_mqa12"
    short, failed, later = pools(2).run(pipeline_failing, saved(name), tokenizer_dir, 2)[0]
    assert (failed.status, failed.message) == (500, "generation failed: RuntimeError: out of memory on rank 1")
    model = any_model(name, LAYERS)
    for ended, ids, n in [(short, [5, 6, 7], 3), (later, [8, 9], 8)]:
        assert tokens_of(ended) == generate(model, torch.tensor([ids]), max_new_tokens=n)[0, len(ids):].tolist()


def generate_on_a_stage(model_dir: str) -> str:
    """A pool task, as a user's script would try it: load with pp_size=2 and call HF generate on what comes back.
    What each rank's generate raised."""
    import torch

    import autotp

    model = autotp.from_pretrained(model_dir, pp_size=2)
    try:
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    except AutotpError as e:
        return str(e)
    return "generate returned"


def test_hf_generate_on_one_stage_is_refused_on_every_rank_without_a_hang(pools, saved):
    """A stage holds part of the layers (the rest are stubs): its forward alone would return made-up logits, so a
    user's generate on it is refused at once on each rank, before any collective, naming the stage and the engine."""
    said = pools(2).run(generate_on_a_stage, saved("gpt_bigcode_mqa12"), timeout=120)
    assert said[0].startswith("this model is stage 0 of a 2-stage pipeline (layers 0-2)"), said
    assert said[1].startswith("this model is stage 1 of a 2-stage pipeline (layers 3-4)"), said
    assert all("only autotp serve's engine runs its forward" in s for s in said), said


@pytest.mark.parametrize("args, words", [
    (["serve", "--pp", "2", "--compile"], ["--compile", "--pp 2", "leave out --compile"]),
    (["serve", "--pp", "2", "--pp-layers", "1,1,2"], ["--pp-layers gives 3 stages (1,1,2) for --pp 2"]),
    (["plan", "--tp", "1", "--pp", "5"], ["--pp 5 exceeds the model's 4 decoder layers"]),
    (["plan", "--tp", "1", "--pp", "2", "--pp-layers", "1,2"], ["1,2", "sum to the model's 4 layers, not 3"]),
    (["serve", "--pp", "2", "--pp-layers", "2,0"], ["every stage needs a layer at least"]),
])
def test_a_pipeline_that_cannot_be_is_refused_in_one_line_before_anything_starts(capsys, args, words):
    from commands import cli

    code, out, err = cli(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err


@pytest.mark.slow
def test_generate_pp_prints_what_one_process_prints_and_a_split_that_cannot_be_prints_no_prompt():
    """`autotp generate --pp N` as a user types it: the same screen as without --pp (the prompt, its greedy
    completion, one newline); a split the model cannot take is one line on stderr, with no prompt echoed before it."""
    from commands import autotp, error_lines

    prompt = ["--prompt", "def add(a, b):", "--max-new-tokens", "6"]
    one, piped = autotp("generate", *prompt), autotp("generate", "--pp", "2", *prompt)
    assert one.returncode == 0 and piped.returncode == 0, piped.stderr
    assert piped.stdout == one.stdout and piped.stdout.startswith("def add(a, b):"), (piped.stdout, one.stdout)
    bad = autotp("generate", "--pp", "5", *prompt)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert error_lines(bad.stderr) == ["autotp: error: --pp 5 exceeds the model's 4 decoder layers: each stage holds "
                                       "one at least"], bad.stderr


def test_plan_shows_each_stage_s_layers_and_kv_bytes(capsys):
    """The demo model (4 layers, 12 heads of 24, one K/V head, float32) at --tp 2 --pp 2, as `autotp plan` prints
    it: each rank's stage, layers and bytes per cached token, the tied embedding read by the last stage's head."""
    from commands import cli

    code, out, err = cli(capsys, "plan", "--tp", "2", "--pp", "2", "--json")
    assert code == 0, err
    ranks = json.loads(out)["ranks"]
    assert [(r["rank"], r["stage"], r["layers"]) for r in ranks] == [(0, 0, [0, 2]), (1, 0, [0, 2]), (2, 1, [2, 4]),
                                                                      (3, 1, [2, 4])]
    per_token = 2 * 2 * 1 * 24 * 4  # keys and values, 2 layers, its 1 K/V head of 24, float32
    assert {r["kv_bytes_per_token"] for r in ranks} == {per_token}
    names = [{t["name"] for t in r["tensors"]} for r in ranks]
    assert "transformer.wte.weight" in names[0] and "lm_head.weight" not in names[0]
    assert "lm_head.weight" in names[2] and "transformer.wte.weight" not in names[2]  # the tied weight, as the head's


@pytest.mark.slow
def test_serve_pp_2_on_one_host_answers_as_one_process_generates(tmp_path):
    """A developer without two machines: `autotp serve --pp 2` on one host (its launcher starts both stages); a
    greedy completion, whole and streamed, is the demo model's own, and the router's /server_info says pp_size 2."""
    from serve_harness import Server

    import autotp
    from autotp.cli import default_model
    from autotp.generate import generate
    from autotp.tokenizer import load_tokenizer

    server = Server(None, tmp_path / "serve.log", "--pp", "2", torchrun=False)
    try:
        whole = server.client.completions.create(model="autotp-demo", prompt="def fib(n):", max_tokens=16,
                                                 temperature=0)
        streamed = "".join(c.choices[0].text for c in server.client.completions.create(
            model="autotp-demo", prompt="def fib(n):", max_tokens=16, temperature=0, stream=True) if c.choices)
        with urllib.request.urlopen(server.url + "/get_server_info", timeout=10) as r:
            info = json.loads(r.read())
    finally:
        server.kill()
    tokenizer = load_tokenizer(default_model())
    model = autotp.from_pretrained(default_model(), dtype="float32")
    ids = tokenizer("def fib(n):", return_tensors="pt").input_ids
    new = generate(model, ids, max_new_tokens=16)[0, ids.shape[1]:]
    assert whole.choices[0].text == streamed == tokenizer.decode(new, skip_special_tokens=True)
    assert (info["tp_size"], info["pp_size"]) == (1, 2)
    assert "tp=1 pp=2" in server.text()


def rank_of(pid: int) -> int:
    """A launched rank's RANK, from its environment."""
    env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    return int(env["RANK"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stage_killed_or_stopped_mid_stream_is_named_once_and_every_rank_exits_in_seconds(tmp_path):
    """Two `autotp serve --pp 2`, each streaming: rank 0 of one is SIGKILLed, rank 1 of the other SIGSTOPped.
    Killed: one line, the launcher's, naming rank 0 (not rank 1's gloo text as well). Stopped: the client's stream
    ends within the liveness window, every rank exits seconds later (not after the launcher's 30 s grace period) and
    the last line names rank 1 as stalled, not as killed by the launcher's own SIGKILL."""
    import signal
    import threading
    import time

    from serve_harness import Server, alive

    from autotp.serve.pipeline.liveness import LOST_S

    killed = Server(None, tmp_path / "killed.log", "--pp", "2", torchrun=False, wait=False)
    stopped = Server(None, tmp_path / "stopped.log", "--pp", "2", torchrun=False, wait=False)
    ended: dict[str, float] = {}
    try:
        for name, server, fault, victim in (("killed", killed, signal.SIGKILL, 0),
                                            ("stopped", stopped, signal.SIGSTOP, 1)):
            server.up()
            stream = iter(server.client.completions.create(model="autotp-demo", prompt="def f():", max_tokens=400,
                                                           temperature=0.9, stream=True))
            next(stream)
            pid = next(p for p in server.ranks if rank_of(p) == victim)

            def drain(stream=stream, name=name):
                try:
                    for _ in stream:
                        pass
                except Exception:  # noqa: BLE001 - the stream's end is what is timed
                    pass
                ended[name] = time.monotonic()

            client = threading.Thread(target=drain)
            client.start()
            hit = time.monotonic()
            os.kill(pid, fault)
            server.proc.wait(timeout=60)
            ended[name + " exit"] = time.monotonic() - hit
            client.join(30)
            ended[name] -= hit
            server.victim = pid
    finally:
        for server in (killed, stopped):
            for pid in getattr(server, "ranks", []):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            server.kill()
    errors = [line for line in killed.text().splitlines() if "error" in line]
    assert errors == [f"autotp: error: rank 0 (pid {killed.victim}) died of SIGKILL"], killed.text()
    assert ended["killed exit"] < 10, ended
    assert killed.text().count("autotp serve: loading autotp-demo (tp=1 pp=2)") == 1  # the launcher's, not rank 0's
    said = [line for line in stopped.text().splitlines() if line.startswith("autotp")]
    assert ended["stopped"] < LOST_S + 4 and ended["stopped exit"] < LOST_S + 6, ended
    assert said[-1].startswith(f"autotp: error: rank 1 (pid {stopped.victim}) stalled: its process was stopped"), said
    assert not any("SIGKILL" in line for line in said), said
