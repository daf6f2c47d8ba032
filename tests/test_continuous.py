"""The continuous-batching engine of `autotp serve`, without HTTP: joins, leaves, chunks, budgets, lockstep.

The oracle is always the same prompt generated alone, unsharded, by `autotp.generate.generate` (HF
`generate`, through the same per-row sampler): a row's tokens must not depend on what else runs, when it
joined, whether its prompt was prefilled in chunks, or on how many ranks hold the model. Rows arrive at
different steps; some prompts are longer than a chunk; there are more rows than `max_num_seqs`.
"""

from __future__ import annotations

import checkpoints
import pytest
import torch
from checkpoints import saver, word_tokenizer
from engine_driver import drive, engine_for, job, tokens_of
from families import MODELS, any_model
from rows import LIMITS, SPEC, alone, arrivals, prompts

from autotp.generate import generate


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(name) -> the directory of that model's checkpoint, written once for the module."""
    return saver(tmp_path_factory, any_model)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(word_tokenizer(tmp_path_factory.mktemp("words")))


@pytest.mark.parametrize("name", MODELS)
def test_every_row_gets_the_tokens_it_gets_alone(name, tokenizer):
    """tp 1: sliding windows (mistral, gemma2: window 4), ALiBi, MoE, Conv1D, ... through join/leave/chunk."""
    model = any_model(name)
    jobs = arrivals()
    engine = engine_for(model, tokenizer, LIMITS)
    seen = []
    drive(engine, jobs, on_step=lambda s, e: seen.append(len(e.executor.runner.requests())))
    assert [tokens_of(j.ended) for js in jobs.values() for j in js] == alone(model)
    assert max(seen) == LIMITS.max_num_seqs, "the rows never ran together"


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_sharded_rows_get_the_unsharded_tokens(pools, saved, tokenizer, name, tp):
    """Uneven heads, KV heads < tp, multi-query, ALiBi, MoE: rank 0 schedules, the others follow."""
    from engine_driver import serve_rows

    ranks = pools(tp).run(serve_rows, saved(name), tokenizer.name_or_path, prompts(), SPEC, LIMITS)
    assert ranks[1:] == [None] * (tp - 1)
    assert [tokens_of(e) for e in ranks[0]] == alone(any_model(name))


def test_a_seeded_row_joining_a_busy_batch_midway_gets_its_text_alone(tokenizer):
    """The issue's test: the same sampled request alone, and arriving while five others decode."""
    model = any_model("gpt_bigcode_mqa12")
    ids = prompts()[3]
    lone = job(ids, 20, 0.8, seed=5, stream=True)
    drive(engine_for(model, tokenizer), {0: [lone]})
    late = job(ids, 20, 0.8, seed=5, stream=True, index=9)
    busy = {0: [job(p, 30, 1.0, seed=i, index=i) for i, p in enumerate(prompts()[:5])], 6: [late]}
    drive(engine_for(model, tokenizer), busy)
    assert late.result.text == lone.result.text and late.streamed == lone.streamed
    assert len(lone.result.tokens) == 20


def test_a_cancelled_row_leaves_at_the_next_step_and_frees_its_memory(tokenizer):
    model = any_model("llama")
    engine = engine_for(model, tokenizer)
    jobs = [job([5, 6, 7], 30, index=i) for i in range(3)]
    rows = []

    def cancel_at_5(step, e):
        rows.append(len(e.executor.runner.requests()))
        if step == 5:
            jobs[1].cancel(e)

    drive(engine, {0: jobs}, on_step=cancel_at_5)
    assert rows[5] == 3 and rows[6] == 2  # flagged before step 5: gone in step 5, memory with it
    assert jobs[1].ended is None  # nobody is answered whose client went away
    assert tokens_of(jobs[0].ended) == tokens_of(jobs[2].ended)


def test_every_step_costs_one_forward_and_one_broadcast(pools, saved, tokenizer):
    """Per step the ranks pay the model's own collectives once and one broadcast of the step, nothing more:
    a step that prefills a new prompt while the others decode runs them in the same forward; no input-guard
    all-reduce (rank 0 sends the inputs), no cancellation flags, no outcome gather."""
    from engine_driver import step_collectives

    out = pools(2).run(step_collectives, saved("gpt_bigcode_mqa12"), tokenizer.name_or_path)[0]
    forward = out["forward"]
    assert forward == {"all_reduce": 2 * 2 + 1, "all_gather": 1}  # 2 layers x 2, the embedding; logits
    ran = [(work, counts) for work, counts in out["steps"] if work]
    mixed = [counts for work, counts in ran if {len(w.tokens) > 1 for w in work} == {True, False}]
    assert len(ran) >= 12 and len(mixed) == 1  # the third prompt's prefill beside two decoding rows
    for work, counts in ran:
        assert counts == forward | {"broadcast": 1}, (work, counts)


def test_a_forward_that_raises_fails_its_rows_with_500_and_the_engine_goes_on(tokenizer):
    """The same error on every rank (here: the one rank) fails the rows of that forward; later rows run."""
    model = any_model("llama")
    engine = engine_for(model, tokenizer)
    boom = {"armed": True}
    two_row_decode = (1, 2)  # the rows' tokens flattened into one input

    def raise_once(module, args, kwargs):
        if boom["armed"] and kwargs["input_ids"].shape == two_row_decode:
            boom["armed"] = False
            raise RuntimeError("injected failure")

    hook = model.model.register_forward_pre_hook(raise_once, with_kwargs=True)
    try:
        pair = [job([5, 6, 7], 10, index=0), job([8, 9], 10, index=1)]
        later = job([5, 6, 7], 10, index=2)
        drive(engine, {0: pair, 8: [later]})
    finally:
        hook.remove()
    assert [(j.ended.status, j.ended.message) for j in pair] == [(500, "generation failed: RuntimeError: injected "
                                                                   "failure")] * 2
    x = torch.tensor([later.row.ids])
    assert tokens_of(later.ended) == generate(model, x, max_new_tokens=10)[0, 3:].tolist()


def test_ranks_that_fail_alike_with_their_own_messages_fail_the_rows_and_go_on(pools, saved, tokenizer):
    """The ranks agree on how a step failed by the exception's type: a CUDA out-of-memory message names each
    rank's GPU, and the same failure must not read as ranks out of lockstep (which shuts the server down)."""
    from engine_driver import failing_alike

    ranks = pools(2).run(failing_alike, saved("llama"), tokenizer.name_or_path)
    assert ranks[1] is None
    first, second, later = ranks[0]
    message = "generation failed: RuntimeError: out of memory on GPU 0"  # rank 0's words
    assert (first.status, first.message) == (second.status, second.message) == (500, message)
    x = torch.tensor([[5, 6, 7]])
    assert tokens_of(later) == generate(any_model("llama"), x, max_new_tokens=10)[0, 3:].tolist()


def test_rank_0s_failure_on_one_rows_log_probabilities_fails_that_row_only(tokenizer, monkeypatch):
    """Sampling and log-probabilities run on rank 0 alone, after the forward: what they raise (an allocation
    for a long prompt's scores) fails the rows that asked for them with 500; the others and the engine go on."""
    from autotp.serve.runner import next_tokens

    model = any_model("llama")
    plain, asks = job([5, 6, 7], 10, index=0), job([8, 9], 10, index=1, logprobs=2)
    echo = job([5, 6, 7, 8], 10, index=2, prompt_logprobs=True, logprobs=0)
    later = job([5, 6, 7], 10, index=3)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(next_tokens, "logprob_rows", out_of_memory)
    drive(engine_for(model, tokenizer), {0: [plain, asks], 3: [echo], 6: [later]})
    expected = "generation failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB"
    assert [(j.ended.status, j.ended.message) for j in (asks, echo)] == [(500, expected)] * 2
    alone_ = generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=10)[0, 3:].tolist()
    assert tokens_of(plain.ended) == tokens_of(later.ended) == alone_


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_rows_get_what_one_process_gives(pools, tokenizer, tmp_path, kind):
    """`autotp serve --quantize`: the engine at tp 2 on a quantized multi-query model gives each row the tokens
    the same model quantized in one process gives it alone (test_quant's shapes: groups of 32 stay whole)."""
    from engine_driver import serve_rows
    from quant_models import GROUP, config

    import autotp

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    checkpoints.widen(AutoModelForCausalLM.from_config(config("bigcode_mqa"), dtype=torch.float32)).save_pretrained(
        tmp_path)
    ranks = pools(2).run(serve_rows, str(tmp_path), tokenizer.name_or_path, prompts(), SPEC, LIMITS, kind, GROUP)
    assert [tokens_of(e) for e in ranks[0]] == alone(autotp.from_pretrained(str(tmp_path), quantize=kind,
                                                                          group_size=GROUP))
