"""Prompt-lookup speculation (`autotp serve --speculate K`): drafts found by hand (the scheduler's entries:
test_scheduler.py), and rows with drafts against the same rows without (the oracle: HF `generate`, and the engine
without drafts).

A drafted token stands only where the row's own sampler drew it, so a row's tokens are the same with and
without speculation: greedy and seeded alike. The random test models rarely repeat their prompt, so they test
drafts that are refused (their keys and values stale, overwritten); the demo model, a trained code model,
repeats itself and tests drafts that stand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import word_tokenizer
from engine_driver import drive, engine_for, job, recorded, run_on_ranks, tokens_of
from families import any_model
from serve_harness import Server

from autotp.generate import generate
from autotp.serve.api.metrics import Metrics
from autotp.serve.engine.lookup import draft

DEMO = str(__import__("pathlib").Path(__import__("autotp").__file__).parent / "demo_model")
CODE = "def print_hello_world():"  # the demo model goes on with "if not None:" lines, again and again


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(word_tokenizer(tmp_path_factory.mktemp("words")))


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(DEMO)


def test_a_draft_is_what_followed_the_newest_earlier_occurrence_of_the_last_ngram():
    def d(tokens, k):
        return draft(np.array(tokens), k)

    assert d([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 3) == (5, 7, 1)  # (1 2 3) at 0 and 5: the newer one
    assert d([4, 5, 6, 8, 5, 6], 2) == (8, 5)  # no earlier (8 5 6): the 2-gram (5 6) at 1
    assert d([1, 2, 3, 4, 2, 3], 9) == (4, 2, 3)  # k beyond the tokens: what there is
    assert d([1, 2, 3, 1], 4) == ()  # a single repeated token is no match
    assert d([7, 7, 7, 7], 4) == (7,)  # the tail overlapping its own match
    assert d([1, 2, 1, 2], 0) == () and d([1], 3) == () and d([], 3) == ()


@pytest.mark.parametrize("name", ["gpt_bigcode_mqa12", "llama", "mistral", "gpt2"])
def test_refused_drafts_change_no_token_and_no_score(name, tokenizer):
    """Random models (multi-query, grouped-query, a sliding window of 4, Conv1D): prompts that repeat
    themselves, so there are drafts, nearly all refused. Greedy tokens and
    their log-probabilities, and a seeded row's tokens, equal the engine's without drafts and HF generate's."""
    model = any_model(name)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 101, (12,), generator=g).tolist() * 2
    ended = {}
    for k in (0, 4):
        engine = engine_for(model, tokenizer, speculate=k)
        metrics = Metrics(engine.load)
        jobs = [job(prompt, 30, index=0, logprobs=2), job(prompt[:20], 30, 0.8, seed=3, index=1)]
        drive(engine, {0: jobs[:1], 3: jobs[1:]}, metrics=metrics)
        ended[k] = [j.ended for j in jobs]
        drafted = metrics.drafted._value.get()
    assert drafted > 0
    for with_drafts, without in zip(ended[4], ended[0], strict=True):
        assert tokens_of(with_drafts) == tokens_of(without)
    x = torch.tensor([prompt])
    assert tokens_of(ended[4][0]) == generate(model, x, max_new_tokens=30)[0, 24:].tolist()
    for a, b in zip(ended[4][0].result.logprobs, ended[0][0].result.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_drafts_that_stand_save_steps_and_change_no_text(demo):
    """The demo model repeats the code it is given: drafts stand, the greedy row takes fewer steps, and its
    tokens, its streamed text and a seeded row's text are those without drafts."""
    model, tok = demo
    ids = tok(CODE).input_ids
    out = {}
    for k in (0, 4):
        engine = engine_for(model, tok, speculate=k, block_size=16)
        metrics = Metrics(engine.load)
        greedy = job(ids, 48, index=0, stream=True, stop=("while",))
        steps = drive(engine, {0: [greedy]}, metrics=metrics)
        seeded = job(ids, 48, 0.8, seed=5, index=1, stream=True)
        drive(engine, {0: [seeded]}, metrics=metrics)
        out[k] = (greedy, seeded, steps, metrics.accepted._value.get())
    (g4, s4, steps4, accepted), (g0, s0, steps0, _) = out[4], out[0]
    assert accepted >= 8 and steps4 <= steps0 - 8, (accepted, steps4, steps0)
    assert g4.result == g0.result
    assert s4.result.text == s0.result.text
    assert g4.streamed == g0.streamed == g4.result.text and s4.streamed == s0.streamed
    n = len(g4.result.tokens)
    assert list(g4.result.tokens) == generate(model, torch.tensor([ids]), max_new_tokens=n)[0, len(ids):].tolist()


def test_seeded_rows_whose_drafts_stand_get_the_text_they_get_without(demo):
    """Seeded rows with drafts that stand (at temperature 0.8 the demo's seeded rows draft next to nothing, so
    "the same text" was checked with speculation off in effect): at 0.3 the demo model repeats its code prompt,
    and seeds 5, 9 and 11 accept 36 of 51 draft tokens (counted here). Each row's tokens are those without
    drafts and those of `autotp.generate` with the same seed: a row that took a drafted token equal to the
    argmax without drawing it would leave its generator behind and change the text after it."""
    model, tok = demo
    ids = tok(CODE).input_ids
    out = {}
    for k in (0, 4):
        engine = engine_for(model, tok, speculate=k, block_size=16)
        metrics = Metrics(engine.load)
        jobs = [job(ids, 40, 0.3, seed=s, index=i, stream=True) for i, s in enumerate((5, 9, 11))]
        drive(engine, {0: jobs}, metrics=metrics)
        out[k] = ([j.result for j in jobs], [j.streamed for j in jobs], metrics)
    (with_drafts, streamed4, m4), (without, streamed0, _) = out[4], out[0]
    assert m4.accepted._value.get() >= 20 and m4.drafted._value.get() >= 30, (m4.accepted._value.get(),
                                                                              m4.drafted._value.get())
    assert [r.tokens for r in with_drafts] == [r.tokens for r in without]
    assert [r.text for r in with_drafts] == [r.text for r in without] == streamed4 == streamed0
    for r, seed in zip(with_drafts, (5, 9, 11), strict=True):
        alone = generate(model, torch.tensor([ids]), max_new_tokens=40, do_sample=True, temperature=0.3, seed=seed)
        assert list(r.tokens) == alone[0, len(ids):].tolist()


def test_a_prompt_extending_a_speculative_rows_output_reads_no_stale_cache_block(demo):
    """A row with drafts, some refused, leaves its blocks in the prefix cache; the editor then sends its prompt
    plus the completion it got plus a few tokens: served from those blocks, it gets the tokens it gets cold.
    A block that kept a refused draft's keys and values would change them."""
    model, tok = demo
    ids = tok(CODE).input_ids
    engine = engine_for(model, tok, speculate=4)
    metrics = Metrics(engine.load)
    first = job(ids, 40, index=0)
    drive(engine, {0: [first]}, metrics=metrics)
    assert metrics.drafted._value.get() > metrics.accepted._value.get() > 0
    resent = ids + list(first.result.tokens) + tok("    return").input_ids
    sent = recorded(engine)
    again = job(resent, 16, index=1, logprobs=1)
    drive(engine, {0: [again]})
    assert sent[0].work[0].start >= len(ids)  # served from the cache past the first prompt
    cold = job(resent, 16, index=1, logprobs=1)
    drive(engine_for(model, tok, caching=False), {0: [cold]})
    assert tokens_of(again.ended) == tokens_of(cold.ended)
    for a, c in zip(again.result.logprobs, cold.result.logprobs, strict=True):
        assert a.logprob == pytest.approx(c.logprob, abs=1e-4)


def _sharded_demo_rows(prompt: list[int]) -> list | None:
    from transformers import AutoTokenizer

    import autotp

    model = autotp.from_pretrained(DEMO, check_inputs=False, dtype="float32")
    ended = run_on_ranks(model, AutoTokenizer.from_pretrained(DEMO), lambda: {
        0: [job(prompt, 40, index=0)], 2: [job(prompt[:30], 24, 0.8, seed=9, index=1)]}, speculate=4)
    return None if ended is None else [e for e, _ in ended]


@pytest.mark.parametrize("tp", [2, 3])
def test_sharded_rows_with_drafts_get_the_unsharded_tokens(pools, demo, tp):
    model, tok = demo
    ids = tok(CODE).input_ids
    greedy, seeded = pools(tp).run(_sharded_demo_rows, ids)[0]
    assert tokens_of(greedy) == generate(model, torch.tensor([ids]), max_new_tokens=40)[0, len(ids):].tolist()
    alone = job(ids[:30], 24, 0.8, seed=9)
    drive(engine_for(model, tok), {0: [alone]})
    assert tokens_of(seeded) == tokens_of(alone.ended)


def test_a_client_of_a_speculating_server_gets_the_text_it_gets_without(demo, tmp_path):
    """`autotp serve --speculate 4` at tp 2 through the openai client: greedy text equal to the unsharded
    model's, the stream joined equal to it, and /metrics counting drafts that stood."""
    model, tok = demo
    server = Server(DEMO, tmp_path / "server.log", "--speculate", "4")
    try:
        assert "speculation up to 4 tokens" in server.text()
        answer = server.client.completions.create(model=server.model_id, prompt=CODE, max_tokens=40, temperature=0)
        ids = tok(CODE).input_ids
        want = generate(model, torch.tensor([ids]), max_new_tokens=40)[0, len(ids):].tolist()
        assert answer.choices[0].text == tok.decode(want, skip_special_tokens=True)
        stream = server.client.completions.create(model=server.model_id, prompt=CODE, max_tokens=40, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == answer.choices[0].text
        from serve_harness import metrics

        seen = metrics(server)
        assert seen["autotp:spec_decode_num_accepted_tokens_total"] > 0
        assert seen["autotp:spec_decode_num_draft_tokens_total"] >= seen["autotp:spec_decode_num_accepted_tokens_total"]
    finally:
        server.kill()
