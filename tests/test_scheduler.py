"""The scheduler by hand, in process and without a model: what each step computes in which blocks, admission under
the budgets, prefix reuse, drafts, and the step taken back by request id (engine/scheduler.py).

A test plays the runner and the output processor itself: it schedules a step, appends the tokens a sampler would
have drawn to the requests that sampled, and hands the step back with `update`.
"""

from __future__ import annotations

import pytest

from autotp.serve.engine.blocks import BlockPool
from autotp.serve.engine.request import Request, Status
from autotp.serve.engine.scheduler import Limits, Scheduler
from autotp.serve.engine.stats import StepStats
from autotp.serve.types import Row


def request(i: int, prompt, max_tokens: int = 5, prompt_logprobs: bool = False, client: str = "") -> Request:
    return Request(i, client or f"client{i}", 0, Row(tuple(prompt), max_tokens, 0.0, 1.0, 0,
                                                     prompt_logprobs=prompt_logprobs))


def ran(scheduler: Scheduler, step, drawn: dict[int, list[int]] | None = None, finish: tuple[int, ...] = ()) -> None:
    """The runner ran `step` and the output processor took `drawn` (request id -> its tokens, in order; a sampling
    request not named draws token 0); the requests in `finish` ended with their last token."""
    for w in step.work:
        r = scheduler.running[w.id]
        if w.sample:
            r.output += (drawn or {}).get(w.id, [0])
        if w.id in finish:
            r.status = Status.STOPPED
    scheduler.update(step)


def served(scheduler: Scheduler, r: Request, drawn: list[int]) -> None:
    """r from admission to its end, its sampler drawing `drawn` (its last token ends it)."""
    scheduler.add(r)
    left = list(drawn)
    while r.id in scheduler.running or r.status is Status.WAITING:
        step = scheduler.schedule(StepStats())
        mine = [w for w in step.work if w.id == r.id]
        last = bool(mine) and mine[0].sample and len(left) == 1
        ran(scheduler, step, {r.id: [left.pop(0)]} if mine and mine[0].sample else {}, (r.id,) if last else ())


def test_a_prompt_extending_a_cached_one_computes_only_its_new_blocks_and_always_its_last_token():
    scheduler = Scheduler(BlockPool(16, 4), Limits(4, 64, 64))
    cached = list(range(1, 13))  # three full blocks
    served(scheduler, request(0, cached + [0], max_tokens=1), [50])
    scheduler.add(request(1, cached + [13, 14]))
    (w,) = scheduler.schedule(StepStats()).work
    assert (w.start, w.tokens, w.sample, w.every) == (12, (13, 14), True, False) and len(w.blocks) == 4  # 3 shared
    assert w.copy == ()  # nothing known after the third block but the first request's tail (0, not 13)
    # the same 12 tokens again: the third block is not taken whole, its last token gives the first new one; its
    # first three keys and values are copied into the request's own block
    scheduler.add(request(2, cached))
    (w,) = scheduler.schedule(StepStats()).work
    assert w.start == 11 and w.tokens == (12,) and w.copy == (2, w.blocks[2], 3)  # request 0's third block
    # a request that wants its prompt's log-probabilities computes everything
    scheduler.add(request(3, cached, prompt_logprobs=True))
    (w,) = scheduler.schedule(StepStats()).work
    assert w.start == 0 and w.every and w.copy == ()


def test_admission_waits_for_blocks_first_come_first_served_and_running_requests_compute_every_step():
    scheduler = Scheduler(BlockPool(6, 4), Limits(4, 8, 24))
    # 10 + 7 - 1 = 16 slots: 4 blocks for its life; the second (4 + 9 - 1 = 12 slots: 3 blocks) would need 7 of 6
    scheduler.add(request(0, range(10), 7))
    scheduler.add(request(1, range(50, 54), 9))
    step = scheduler.schedule(StepStats())
    assert [(w.id, len(w.tokens)) for w in step.work] == [(0, 8)]  # the 8-token budget
    ran(scheduler, step)
    step = scheduler.schedule(StepStats())
    assert [(w.id, w.tokens, w.start) for w in step.work] == [(0, (8, 9), 8)] and scheduler.waiting[0].id == 1


def test_a_draft_is_fed_after_the_last_token_and_only_the_tokens_that_stand_are_kept():
    scheduler = Scheduler(BlockPool(16, 4), Limits(4, 4, 64), speculate=5)
    prompt = (5, 9, 7, 7, 7, 7, 7, 1, 2, 5)  # after (5, 9) came five 7s: the draft once the request draws 9
    r = request(0, prompt, 10)
    scheduler.add(r)
    for _ in range(3):  # a budget of 4: the prompt in chunks of 4, 4, 2; the last samples 9
        ran(scheduler, scheduler.schedule(StepStats()), {0: [9]})
    assert r.computed == 10 and r.output == [9]
    step = scheduler.schedule(StepStats())
    (w,) = step.work
    assert (w.tokens, w.start, w.sample, w.every, w.draft) == ((9, 7, 7, 7), 10, True, True, 3)  # the budget cuts
    assert len(w.blocks) == 1  # positions 10..13 reach a fourth block
    ran(scheduler, step, {0: [7, 8]})  # the sampler drew 7 (the draft's first), then 8
    assert r.computed == 12 and len(r.keys) == 3  # 9 and the 7 stand: blocks 0-3, 4-7, 8-11 full and cached
    (w,) = scheduler.schedule(StepStats()).work
    assert (w.tokens[0], w.start) == (8, 12)  # the next step computes from the first token that did not stand


def test_a_finished_requests_last_block_claims_only_the_tokens_that_were_computed():
    """A request that stops leaves its partly filled last block indexed for later prompts: with the tokens whose keys
    and values were computed, never its last generated one, which was sampled and never fed back."""
    pool = BlockPool(8, 4)
    scheduler = Scheduler(pool, Limits(4, 64, 32))
    r = request(0, [1, 2, 3, 4, 5], 4)
    served(scheduler, r, [6, 7, 8])  # 1 2 3 4 | 5 6 7 (8: sampled, never computed)
    assert r.output == [6, 7, 8] and r.computed == 7
    [(_, known)] = [(b, tokens) for b, (_, tokens) in pool.tails.items()]
    assert known == (5, 6, 7)


def test_admission_counts_the_idle_cached_blocks_its_prefix_takes_out_of_the_free_room():
    """Under memory pressure: a prompt whose cached prefix is idle (nobody holds it) takes that room too. Admitted by
    its new blocks alone, it would be promised blocks that are not there: `cannot reserve 1 blocks: 0 available`."""
    pool = BlockPool(6, 4)
    scheduler = Scheduler(pool, Limits(4, 64, 24))
    served(scheduler, request(0, list(range(1, 9)) + [0], 1), [50])  # 2 full blocks and a tail cached, idle
    assert pool.available() == 6 and len(pool.idle) == 3
    scheduler.add(request(1, range(100, 112), 2))  # 12 + 2 - 1 = 13 slots: 4 blocks, 3 taken now (the free ones)
    scheduler.add(request(2, list(range(1, 9)) + [7], 4))  # 2 cached blocks + 1 new: 1 + the 2 idle it holds = 3
    step = scheduler.schedule(StepStats())
    assert [w.id for w in step.work] == [1] and scheduler.waiting[0].id == 2  # 3 > the 2 left: it waits
    for _ in range(10):  # it is admitted once request 1 leaves, and every block it takes is there
        ran(scheduler, step, finish=tuple(w.id for w in step.work if w.sample and scheduler.running[w.id].output))
        if scheduler.idle():
            break
        step = scheduler.schedule(StepStats())
    assert scheduler.idle()


def test_a_request_that_exactly_fits_the_cache_is_scheduled_to_its_end():
    """prompt + max_tokens - 1 slots (types.kv_slots) is the whole life of a request: one that needs exactly the
    cache runs to its last token; the blocks are never over-promised."""
    scheduler = Scheduler(BlockPool(4, 4), Limits(4, 64, 16))
    r = request(0, range(10), 7)  # 10 + 7 - 1 = 16 slots: all 4 blocks
    served(scheduler, r, list(range(7)))
    assert r.output == list(range(7)) and scheduler.pool.available() == 4


def test_requests_in_flight_are_not_scheduled_again_until_their_step_comes_back():
    """More than one step in flight (a pipeline): each request is in one at most, and each step comes back by its
    requests' ids, in any order."""
    scheduler = Scheduler(BlockPool(32, 4), Limits(8, 64, 128))
    for i in range(2):
        scheduler.add(request(i, [1 + i, 2, 3], 4))
    first = scheduler.schedule(StepStats())
    scheduler.add(request(2, [9, 9], 4))
    second = scheduler.schedule(StepStats())
    assert [w.id for w in first.work] == [0, 1] and [w.id for w in second.work] == [2]
    assert scheduler.schedule(StepStats()).work == ()  # everyone is in flight
    ran(scheduler, second)
    assert [w.id for w in scheduler.schedule(StepStats()).work] == [2]
    ran(scheduler, first, finish=(0,))
    third = scheduler.schedule(StepStats())
    assert [w.id for w in third.work] == [1] and third.finished == (0,)  # the runners forget request 0 with it


def test_an_aborted_request_leaves_the_queue_or_is_freed_once_its_step_comes_back():
    scheduler = Scheduler(BlockPool(16, 4), Limits(4, 64, 64))
    waiting, running = request(0, [1, 2, 3]), request(1, [4, 5, 6])
    scheduler.add(running)
    step = scheduler.schedule(StepStats())
    scheduler.add(waiting)
    scheduler.abort(waiting, Status.ABORTED)
    scheduler.abort(running, Status.ABORTED)  # in flight: freed when its step comes back
    assert not scheduler.waiting and 1 in scheduler.running
    ran(scheduler, step)
    assert not scheduler.running and scheduler.pool.available() == 16


@pytest.mark.parametrize("caching", [True, False])
def test_a_steps_tokens_stay_within_the_budget_and_new_requests_are_admitted_first_come_first_served(caching):
    scheduler = Scheduler(BlockPool(64, 4, caching), Limits(3, 10, 256))
    for i in range(5):
        scheduler.add(request(i, range(100 * i, 100 * i + 7), 3))
    seen = []
    for _ in range(40):
        step = scheduler.schedule(StepStats())
        if not step.work:
            break
        assert sum(len(w.tokens) for w in step.work) <= 10 and len(scheduler.running) <= 3
        seen += [n.id for n in step.new]
        ran(scheduler, step, finish=tuple(w.id for w in step.work if w.sample and
                                          len(scheduler.running[w.id].output) == 2))
    assert seen == [0, 1, 2, 3, 4] and not scheduler.running


def test_a_prompt_sent_several_times_at_once_is_computed_once():
    """n completions of one prompt (llama.vscode's n_cmpl 3): the first computes it, the others wait for its blocks
    to be cached and compute only the last, partly filled block's tokens."""
    scheduler = Scheduler(BlockPool(32, 4), Limits(8, 64, 128))
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    for i in range(3):
        scheduler.add(request(i, prompt, client="n3"))
    step = scheduler.schedule(StepStats())
    assert [(w.id, len(w.tokens)) for w in step.work] == [(0, 14)] and len(scheduler.waiting) == 2
    ran(scheduler, step)
    step = scheduler.schedule(StepStats())
    assert [(w.id, w.start, len(w.tokens)) for w in step.work] == [(0, 14, 1), (1, 12, 2), (2, 12, 2)]


def test_a_row_waits_only_for_its_siblings_blocks_and_never_for_another_requests():
    scheduler = Scheduler(BlockPool(32, 4), Limits(8, 64, 128))
    scheduler.add(request(0, list(range(1, 15)), client="a"))
    scheduler.schedule(StepStats())
    scheduler.add(request(1, [9, 9, 9, 9, 9, 9], client="a"))  # nothing in common: admitted beside it
    scheduler.add(request(2, [1, 2, 3], client="a"))  # no full block it could take from the cache
    scheduler.add(request(3, list(range(1, 15)), client="b"))  # the same prompt from another client: no wait
    assert [w.id for w in scheduler.schedule(StepStats()).work] == [1, 2, 3]


def test_a_pipeline_keeps_its_lanes_apart_and_even():
    """Two lanes (a pipeline of 2 stages): each step computes one lane's requests, so two steps are in flight at
    once with no request in both; admissions fill the lanes evenly; a lane's requests wait for their step."""
    scheduler = Scheduler(BlockPool(64, 4), Limits(8, 64, 256), lanes=2)
    for i in range(5):
        scheduler.add(request(i, [1, 2, 3], max_tokens=4))
    first = scheduler.schedule(StepStats(), lane=0)
    second = scheduler.schedule(StepStats(), lane=1)
    lanes = [{w.id for w in first.work}, {w.id for w in second.work}]
    assert not lanes[0] & lanes[1] and lanes[0] | lanes[1] == set(range(5))
    assert sorted(map(len, lanes)) == [2, 3]  # 5 requests: 3 and 2
    assert scheduler.schedule(StepStats(), lane=0).work == ()  # lane 0's step has not come back
    ran(scheduler, first)
    assert {w.id for w in scheduler.schedule(StepStats(), lane=0).work} == lanes[0]
    scheduler.add(request(5, [4, 5, 6], max_tokens=4))
    third = scheduler.schedule(StepStats(), lane=1)  # the shorter lane takes the newcomer, its others still out
    assert [w.id for w in third.work] == [5]
    ran(scheduler, second)
    ran(scheduler, third)
    assert {w.id for w in scheduler.schedule(StepStats(), lane=1).work} == lanes[1] | {5}


def test_a_long_prompt_s_chunks_follow_one_another_into_the_pipeline():
    """A prompt longer than a step's budget: its next chunk goes into the next step (of any lane) while the chunks
    before it are out, so the stages compute it together; the chunk that reaches its end samples, and only then does
    it wait for its step to come back. A failed chunk frees the request only once its later chunks are back."""
    scheduler = Scheduler(BlockPool(64, 4), Limits(4, 16, 256), lanes=2)
    scheduler.add(request(0, list(range(1, 41)), max_tokens=3))
    steps = [scheduler.schedule(StepStats(), lane=i % 2) for i in range(4)]
    assert [[(w.start, len(w.tokens), w.sample) for w in s.work] for s in steps] == [
        [(0, 16, False)], [(16, 16, False)], [(32, 8, True)], []]
    r = scheduler.running[0]
    assert r.in_flight == 3 and r.computed == 0
    ran(scheduler, steps[0])
    assert r.computed == 16 and scheduler.schedule(StepStats(), lane=0).work == ()  # the sampling chunk is out
    ran(scheduler, steps[1])
    ran(scheduler, steps[2])
    (w,) = scheduler.schedule(StepStats(), lane=0).work  # its lane: the first generated token, decoded
    assert (w.start, w.tokens, w.sample) == (40, (0,), True)
    scheduler.add(request(1, list(range(41, 81)), max_tokens=3))  # nothing of it cached
    first, second = (scheduler.schedule(StepStats(), lane=1) for _ in range(2))
    failed = scheduler.running[1]
    failed.status = Status.FAILED  # the engine answered 500: the first chunk's forward failed
    scheduler.update(first, ran=False)
    assert 1 in scheduler.running and failed.in_flight == 1  # its second chunk is still out, writing its blocks
    scheduler.update(second)
    assert 1 not in scheduler.running and not scheduler.pool.match(failed.prompt, 9)  # freed, nothing of it cached
