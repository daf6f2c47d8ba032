"""The paged engine: the block pool and its prefix cache by hand, budgets through the engine, and rows served from
cached blocks against the same rows computed cold (the oracle: HF `generate` of the prompt alone).

A prompt served from cached blocks is computed in other chunks than cold (its prefix in an earlier
forward), which reorders float32 sums: its tokens must be the same greedy tokens, its scores equal within
float32 tolerance, never bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import word_tokenizer
from engine_driver import a_long_prompt_beside_decoding_rows, drive, engine_for, job, recorded, tokens_of
from families import any_model

from autotp.generate import generate
from autotp.serve.engine.blocks import BlockPool
from autotp.serve.engine.scheduler import Limits


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(word_tokenizer(tmp_path_factory.mktemp("words")))


def held(pool: BlockPool, tokens: list[int]) -> list[int]:
    """A row that computed `tokens` and left: its full blocks cached, chained, then released."""
    blocks, parent = [], None
    pool.reserve(len(tokens) // pool.block_size)
    for i in range(len(tokens) // pool.block_size):
        blocks.append(pool.take())
        parent = pool.register(blocks[-1], parent, tuple(tokens[i * pool.block_size:(i + 1) * pool.block_size]))
    for b in blocks:
        pool.release(b)
    return blocks


def test_the_longest_cached_run_of_full_blocks_is_found_by_hand():
    pool = BlockPool(8, 2)
    a = held(pool, [1, 2, 3, 4, 5, 6])  # blocks (1 2) (3 4) (5 6)
    assert [b for b, _ in pool.match([1, 2, 3, 4, 5, 6, 7], 9)] == a
    assert [b for b, _ in pool.match([1, 2, 3, 4, 9, 9], 9)] == a[:2]  # third block differs
    other = held(pool, [2, 1])  # (2 1) cached too: the lookup of [2, 1, 3, 4] reaches (3 4) with another parent
    assert [b for b, _ in pool.match([2, 1, 3, 4], 9)] == other  # the same (3 4) after another block: another key
    assert [b for b, _ in pool.match([1, 2, 3, 4, 5, 6], 2)] == a[:2]  # limit: the last token is computed again
    assert [b for b, _ in pool.match([1, 2, 3], 9)] == a[:1]  # (3) alone is no full block


def test_idle_cached_blocks_are_evicted_least_recently_used_first_and_free_ones_before_them():
    pool = BlockPool(4, 2)
    first, second = held(pool, [1, 2]), held(pool, [3, 4])
    assert pool.available() == 4 and pool.used() == 0
    pool.reserve(2)
    taken = [pool.take(), pool.take()]  # the two never-used blocks first: both cached prefixes survive
    assert set(taken).isdisjoint(first + second) and pool.match([1, 2], 1) and pool.match([3, 4], 1)
    pool.hold(first[0])  # [1, 2] is used again: now [3, 4] is the oldest idle block
    pool.release(first[0])
    pool.reserve(1)
    assert pool.take() == second[0]
    assert pool.match([3, 4], 1) == [] and [b for b, _ in pool.match([1, 2], 1)] == first


def test_reservations_bound_what_can_be_promised():
    pool = BlockPool(3, 4)
    pool.reserve(2)
    assert pool.available() == 1
    with pytest.raises(RuntimeError, match="cannot reserve 2 blocks: 1 available"):
        pool.reserve(2)
    pool.unreserve(2)
    assert pool.available() == 3


def test_a_second_block_with_the_same_content_stays_uncached_and_caching_off_caches_nothing():
    pool = BlockPool(4, 2)
    original = held(pool, [7, 8])
    copy = held(pool, [7, 8])
    assert copy != original and [b for b, _ in pool.match([7, 8], 1)] == original
    assert len(pool.free) == 3  # the copy went back free, not idle
    off = BlockPool(4, 2, caching=False)
    held(off, [7, 8])
    assert off.match([7, 8], 1) == [] and len(off.free) == 4


def test_a_known_block_is_found_by_its_longest_shared_run_of_tokens_until_evicted_or_flushed():
    pool = BlockPool(6, 4)
    full = held(pool, [1, 2, 3, 4, 5, 6, 7, 8])  # blocks (1 2 3 4) (5 6 7 8)
    first = pool.match([1, 2, 3, 4, 5, 6, 9, 9], 9)
    assert [b for b, _ in first] == full[:1] and pool.extend([1, 2, 3, 4, 5, 6, 9, 9], first, 8) == (full[1], 2)
    assert pool.extend([1, 2, 3, 4, 5, 6, 7, 8], first, 7) == (full[1], 3)  # `end`: the last token is computed again
    assert pool.extend([9, 2, 3], [], 3) == (-1, 0)  # no known block starts with 9
    assert pool.extend([5, 6, 7], [], 3) == (-1, 0)  # (5 6 7 8) is known after (1 2 3 4) only
    # a row that computed 1 2 3 4 | 5 6 and left: its partly filled block is found too, under its parent
    pool.reserve(2)
    row = [pool.take(), pool.take()]
    parent = pool.register(row[0], None, (1, 2, 3, 4))  # a second (1 2 3 4): stays uncached
    pool.release(row[0])
    pool.release(row[1], (parent, (5, 6)))
    assert pool.extend([1, 2, 3, 4, 5, 6, 7, 1], first, 8) == (full[1], 3)  # the full block shares more
    assert pool.extend([1, 2, 3, 4, 5, 9], first, 5) == (row[1], 1)  # a tie: the one indexed last
    assert pool.used() == 0 and pool.available() == 6 and row[1] in pool.idle
    pool.reserve(6)
    taken = [pool.take() for _ in range(3)]  # 3 free ones, then the oldest idle ones: the tail is evicted last
    assert row[1] not in taken
    taken += [pool.take(), pool.take()]
    assert pool.extend([1, 2, 3, 4, 5, 6], first, 6) == (row[1], 2) and full[1] in taken
    assert pool.flush() == 1 and pool.extend([1, 2, 3, 4, 5, 6], first, 6) == (-1, 0) and pool.children == {}
    off = BlockPool(2, 4, caching=False)
    off.reserve(1)
    off.release(off.take(), (None, (1, 2)))
    assert off.extend([1, 2], [], 2) == (-1, 0) and len(off.free) == 2


def test_a_lookup_within_a_block_compares_the_blocks_indexed_last_and_a_bounded_number_of_them():
    """Many known blocks after one parent that start alike (a cached system prompt, then each user's message): the
    lookup compares the EXTEND_CANDIDATES indexed last, so the best of the older ones is passed over."""
    from autotp.serve.engine.blocks import EXTEND_CANDIDATES

    pool = BlockPool(EXTEND_CANDIDATES + 2, 4)
    oldest = held(pool, [1, 2, 3, 4])[0]  # shares 4 tokens with the prompt below
    for i in range(EXTEND_CANDIDATES):  # each shares 2
        held(pool, [1, 2, 100 + i, 0])
    assert pool.extend([1, 2, 100, 0, 5], [], 4)[1] == 4  # the oldest of the compared ones is still found
    assert pool.extend([1, 2, 3, 4, 5], [], 4)[1] == 2  # not `oldest`, which shares 4
    assert pool.match([1, 2, 3, 4, 5], 1) == [(oldest, pool.key_of[oldest])]  # (whole, it is a full-block hit)


def test_a_chat_turn_after_a_completion_computes_from_where_the_completion_stopped(tokenizer):
    """Turn 2 sends turn 1's prompt and completion and a few tokens more (a chat's next message): the completion's
    last, partly filled block is copied, so only its last (never computed) token and the new ones are computed, and
    the text and log-probabilities are what an engine without a cache gives: with the whole answer continued (its
    last token was sampled, never fed back: its keys and values are not in the block, and a block that claimed them
    would hand the next turn a stale key), with the answer's last token replaced, and with a pool so full that the
    block taken for the copy is the copied block itself."""
    model = any_model("llama")
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 101, (10,), generator=g).tolist()
    for kv_tokens, whole, more in ((64, True, [5, 9, 33]), (64, False, [5, 9, 33]), (16, False, [])):
        engine = engine_for(model, tokenizer, limits=Limits(4, 64, kv_tokens))
        turn = job(prompt, 6, index=0)
        drive(engine, {0: [turn]})  # it leaves: 3 full blocks and 3 computed tokens of a fourth kept
        completion = tokens_of(turn.ended)
        second = prompt + (completion if whole else completion[:5]) + (more or [(completion[5] + 1) % 101])
        sent = recorded(engine)
        again = job(second, 4 if more else 1, logprobs=1, index=1)
        drive(engine, {0: [again]})
        first = sent[0].work[0]
        assert first.start == 15 and first.copy[2] == 3, first  # from the answer's last token on
        if not more:  # the only block left was the one copied from
            assert first.copy[0] == first.copy[1]
        x = torch.tensor([second])
        assert tokens_of(again.ended) == generate(model, x, max_new_tokens=len(tokens_of(again.ended)))[
            0, len(second):].tolist()
        with torch.no_grad():
            scores = model(torch.tensor([second + tokens_of(again.ended)])).logits[0].log_softmax(-1)
        want = [scores[len(second) - 1 + i, t].item() for i, t in enumerate(tokens_of(again.ended))]
        assert [e.logprob for e in again.result.logprobs] == pytest.approx(want, abs=1e-4)


def test_a_steps_tokens_stay_within_the_budget_and_every_running_row_computes_in_every_step(tokenizer):
    model = any_model("llama")
    limits = Limits(max_num_seqs=4, max_num_batched_tokens=8, kv_tokens=10_000)
    engine = engine_for(model, tokenizer, limits)
    sent = recorded(engine)
    _, long = a_long_prompt_beside_decoding_rows(engine)
    assert all(sum(len(w.tokens) for w in s.work) <= limits.max_num_batched_tokens for s in sent)
    chunks = [(len(w.tokens), sum(len(v.tokens) == 1 for v in s.work)) for s in sent for w in s.work
              if len(w.tokens) > 1 and len(w.tokens) != 4]
    assert chunks == [(5, 3)] * 9  # 45 tokens: 9 chunks of 5 beside the 3 rows' decodes, in the same forward
    x = torch.tensor([long.row.ids])
    assert tokens_of(long.ended) == generate(model, x, max_new_tokens=4)[0, 45:].tolist()


def test_the_blocks_are_never_overcommitted_and_admission_waits_for_room(tokenizer):
    model = any_model("llama")
    limits = Limits(max_num_seqs=8, max_num_batched_tokens=64, kv_tokens=96)  # 24 blocks of 4
    engine = engine_for(model, tokenizer, limits, caching=False)
    used, together = [], []
    g = torch.Generator().manual_seed(2)
    jobs = [job(torch.randint(0, 101, (10,), generator=g).tolist(), 20, index=i) for i in range(6)]
    update = engine.scheduler.update  # the blocks held when each step comes back, before its finished rows leave
    engine.scheduler.update = lambda step, ran=True: (used.append(engine.scheduler.kv_used()), update(step, ran))
    drive(engine, {0: jobs}, on_step=lambda s, e: together.append(e.load().running))
    # 10 + 19 tokens need 8 blocks: 3 rows fit, a fourth waits; the 3 fill all 24 blocks (96 slots) at their end
    assert max(together) == 3 and max(used) == 96
    for j in jobs:
        assert tokens_of(j.ended) == generate(model, torch.tensor([j.row.ids]), max_new_tokens=20)[0, 10:].tolist()


@pytest.mark.parametrize("name", ["gpt_bigcode_mqa12", "llama", "mistral", "gpt2", "qwen2_moe", "bloom", "mpt",
                                  "falcon_alibi", "falcon_mha", "falcon_gqa", "gemma2"])
def test_a_prompt_served_from_cached_blocks_gets_the_tokens_and_scores_it_gets_cold(name, tokenizer):
    """Multi-query, grouped-query, a sliding window of 4, Conv1D, MoE, ALiBi (from the first key: BLOOM, Falcon;
    from the last: MPT), Falcon's rotary layouts, Gemma 2's soft-capping: the editor's pattern, a prompt then
    the same prompt with a few tokens more, against the second prompt on an engine without a cache, and the
    log-probabilities against the model's own log-softmax over the whole text."""
    model = any_model(name)
    g = torch.Generator().manual_seed(4)
    first = torch.randint(0, 101, (21,), generator=g).tolist()
    second = first + [5, 9, 33]
    warm = engine_for(model, tokenizer)
    drive(warm, {0: [job(first, 6, index=0)]})
    again = job(second, 12, logprobs=3, index=1)
    sent = recorded(warm)
    drive(warm, {0: [again]})
    # five full blocks of 4 from the cache, and the sixth's first token (the first prompt's 21st; its next three were
    # that prompt's completion): 3 of 24 tokens computed
    assert sent[0].work[0].start == 21 and sent[0].work[0].copy[2] == 1
    cold = job(second, 12, logprobs=3, index=1)
    drive(engine_for(model, tokenizer, caching=False), {0: [cold]})
    # the finished row has left: every block released, the cache kept
    assert warm.scheduler.running == {} and warm.scheduler.pool.used() == 0
    assert tokens_of(again.ended) == tokens_of(cold.ended)
    x = torch.tensor([second])
    assert tokens_of(cold.ended) == generate(model, x, max_new_tokens=12)[0, 24:].tolist()
    for a, c in zip(again.result.logprobs, cold.result.logprobs, strict=True):
        assert a.logprob == pytest.approx(c.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in c.top]
    text = second + tokens_of(again.ended)
    with torch.no_grad():
        scores = model(torch.tensor([text])).logits[0].log_softmax(-1)
    want = [scores[23 + i, t].item() for i, t in enumerate(tokens_of(again.ended))]
    assert [e.logprob for e in again.result.logprobs] == pytest.approx(want, abs=1e-4)


def test_the_editor_pattern_reuses_a_cancelled_prompts_blocks(tokenizer):
    """A prompt cancelled mid-generation (the user typed), then the same prompt plus three tokens: its
    blocks were kept, the new request computes only what changed, and its seeded text is the cold one."""
    model = any_model("gpt_bigcode_mqa12")
    engine = engine_for(model, tokenizer)
    sent = recorded(engine)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 101, (30,), generator=g).tolist()
    typing = job(prompt, 40, 0.8, seed=3, index=0)
    drive(engine, {0: [typing]}, on_step=lambda s, e: typing.cancel(e) if s == 4 else None)
    assert typing.ended is None
    sent.clear()
    after = job(prompt + [7, 7, 8], 10, 0.8, seed=3, index=1)
    drive(engine, {0: [after]})
    first = next(w for s in sent for w in s.work)
    # the prompt's 7 full blocks of 4 come from the cache, and the 8th's first two tokens (its last two are generated
    # tokens, which differ): 3 of 33 tokens are computed
    assert first.start == 30 and first.tokens == (7, 7, 8) and first.copy[2] == 2
    cold = job(prompt + [7, 7, 8], 10, 0.8, seed=3, index=1)
    drive(engine_for(model, tokenizer, caching=False), {0: [cold]})
    assert after.result.text == cold.result.text


def test_prompt_log_probabilities_are_computed_in_full_beside_rows_served_from_the_cache(tokenizer):
    model = any_model("llama")
    prompt = list(range(3, 20))
    engine = engine_for(model, tokenizer)
    drive(engine, {0: [job(prompt, 4, index=0)]})
    echo = job(prompt, 4, index=1, prompt_logprobs=True, logprobs=0)
    drive(engine, {0: [echo]})
    cold = job(prompt, 4, index=1, prompt_logprobs=True, logprobs=0)
    drive(engine_for(model, tokenizer, caching=False), {0: [cold]})
    got, want = echo.result.prompt_logprobs, cold.result.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    assert [e.logprob for e in got[1:]] == pytest.approx([e.logprob for e in want[1:]], abs=1e-5)
    scores = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert [e.logprob for e in got[1:]] == pytest.approx([scores[j, prompt[j + 1]].item()
                                                          for j in range(len(prompt) - 1)], abs=1e-4)


def test_a_cached_block_under_another_parent_is_not_served(tokenizer):
    """Cache A + C and B + D, then serve A + D: A comes from the cache, D was cached only after B, so it is
    computed again (its keys and values depend on everything before it). Tokens: HF generate's of A + D;
    log-probabilities: the model's own log-softmax over A + D and the tokens generated; prefix hits: A's."""
    from autotp.serve.api.metrics import Metrics

    model = any_model("llama")
    g = torch.Generator().manual_seed(6)
    a, b, c, d = (torch.randint(0, 101, (8,), generator=g).tolist() for _ in range(4))  # 2 blocks of 4 each
    engine = engine_for(model, tokenizer)
    drive(engine, {0: [job(a + c + [1], 4, index=0), job(b + d + [1], 4, index=1)]})
    metrics = Metrics(engine.load)
    served = job(a + d + [1], 8, logprobs=2, index=2)
    drive(engine, {0: [served]}, metrics=metrics)
    assert metrics.prefix_hits._value.get() == len(a)  # A's blocks, and not D's
    prompt = a + d + [1]
    want = generate(model, torch.tensor([prompt]), max_new_tokens=8)[0, len(prompt):].tolist()
    assert tokens_of(served.ended) == want
    with torch.no_grad():
        scores = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    got = [e.logprob for e in served.result.logprobs]
    assert got == pytest.approx([scores[i, t].item() for i, t in enumerate(want)], abs=1e-4)


def test_under_memory_pressure_a_prompt_whose_prefix_is_cached_waits_for_room_and_gets_its_cold_tokens(tokenizer):
    """An editor's pattern with the cache nearly full: a file's prompt is cached, a long request takes most of the
    pool, and the file comes back with a few tokens more. Its cached prefix is idle room it takes too: it waits until
    the long request leaves, then gets the tokens it gets cold (admitted by its new blocks alone, it was promised
    blocks that were not there, and the next step raised `cannot reserve`: 503 for every request)."""
    model = any_model("llama")
    engine = engine_for(model, tokenizer, limits=Limits(4, 64, 24))  # 6 blocks of 4
    g = torch.Generator().manual_seed(7)
    file = torch.randint(0, 101, (9,), generator=g).tolist()
    drive(engine, {0: [job(file, 1, index=0)]})  # 2 full blocks and a tail cached, idle
    long = job(torch.randint(0, 101, (12,), generator=g).tolist(), 2, index=1)  # 13 slots: 4 blocks
    again = job(file[:8] + [7], 4, index=2)  # 2 cached blocks + 1 new, holding the 2 idle ones
    drive(engine, {0: [long, again]})
    assert [tokens_of(j.ended) for j in (long, again)] == [
        generate(model, torch.tensor([j.row.ids]), max_new_tokens=n)[0, len(j.row.ids):].tolist()
        for j, n in ((long, 2), (again, 4))]
