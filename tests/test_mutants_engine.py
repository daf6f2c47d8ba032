"""Rules of the engine, the pipeline and their wires that one-character bugs broke while the suite passed: each test
here fails when its rule is broken that way (checked by breaking it once).

- a row that ends on its last allowed token by an end token, a FIM sentinel or a stop string ends by "stop";
- a stage's first layer is the sum of the layers before it (an uneven split served end to end, and `autotp plan`);
- a message of exactly the wire's room, and one byte either side, crosses whole (the lockstep channel, the links);
- a stage says which requests its hidden states leave out: a failed chunk fails its own request only;
- a rank that stops beating is found lost (a real TCPStore, a beater that stalls).
"""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from checkpoints import saver, word_tokenizer
from engine_driver import drive, engine_for, job, pipeline_rows, run_on_pipeline, tokens_of
from families import any_model
from rows import LIMITS, SPEC, alone, prompts

from autotp.generate import generate
from autotp.serve.engine.scheduler import Limits

NAME = "gpt_bigcode_mqa12"
LAYERS = 4  # --pp 3 splits them 2, 1, 1 and --pp-layers 1,2,1 as said: the last stage starts at 3, not 2 or 4
PROMPT = [3, 17, 42, 8, 99, 51, 23]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(word_tokenizer(tmp_path_factory.mktemp("words")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saver(tmp_path_factory, lambda name: any_model(name, LAYERS))


# --- 1. the finish reason of a row's last allowed token ---------------------------------------------------------


@pytest.fixture(scope="module")
def greedy(tokenizer):
    """The model, its greedy 12 tokens after PROMPT, and the first place k (past 2) where token k is new and its
    word first shows in the text there: an end token, a stop id or a stop string on it ends the row at k alone."""
    model = any_model(NAME)
    tokens = generate(model, torch.tensor([PROMPT]), max_new_tokens=12)[0, len(PROMPT):].tolist()
    for k in range(2, 12):
        before, upto = (tokenizer.decode(PROMPT + tokens[:i]) for i in (k, k + 1))
        word = upto[len(before):]
        if tokens[k] not in tokens[:k] and word not in before and upto.find(word) == len(before):
            return model, tokens, k, word
    pytest.fail(f"no token of {tokens} is new where it stands: choose another prompt")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("by", ["end token", "stop id", "stop string"])
def test_an_end_on_the_last_allowed_token_is_stop_not_length(greedy, tokenizer, by):
    """max_tokens k + 1 and the row's end (the model's eos, a FIM sentinel of /infill, a stop string) on token k:
    the row ended because it was told to stop, which a client reads from "stop" (llama.vim: stop_type "eos")."""
    model, tokens, k, word = greedy
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = tokens[k] if by == "end token" else None
    try:
        engine = engine_for(model, tokenizer)
    finally:
        model.generation_config.eos_token_id = saved_eos
    row = job(PROMPT, k + 1, stop=(word,) if by == "stop string" else ())
    if by == "stop id":
        row.row = replace(row.row, stop_ids=(tokens[k],))
    control = job(PROMPT, k + 1, index=1)  # the same row without its end (the model has no eos): "length"
    drive(engine, {0: [row]})
    drive(engine_for(model, tokenizer), {0: [control]})
    assert (row.result.finish_reason, tokens_of(row.ended)) == ("stop", tokens[:k + 1])
    assert (control.result.finish_reason, tokens_of(control.ended)) == ("length", tokens[:k + 1])
    if by == "stop string":
        assert row.result.stopped_by == word and word not in row.result.text


# --- 2. an uneven split of the layers ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_an_uneven_split_whose_last_stage_follows_a_short_one_gets_the_unsharded_tokens(pools, saved, tokenizer):
    """--pp 3 --pp-layers 1,2,1: stage 2 holds layer 3 (1 + 2 before it), which stage 0's count alone (2 x 1)
    would make layer 2; every row, joining, chunked and sampled, gets the tokens it gets alone, unsharded."""
    tokenizer_dir = tokenizer.name_or_path
    rows = 3  # a greedy row, a sampled one, a prompt longer than a chunk joining at step 2
    ranks = pools(3).run(pipeline_rows, saved(NAME), tokenizer_dir, prompts()[:rows], SPEC[:rows], LIMITS, 3, 0,
                         (1, 2, 1), timeout=60)
    assert ranks[1:] == [None, None]
    assert [tokens_of(e) for e in ranks[0]] == alone(any_model(NAME, LAYERS))[:rows]


def test_plan_shows_an_uneven_split_s_layer_ranges(capsys):
    """`autotp plan --pp 3` of the demo model (4 layers: 2, 1, 1): each stage starts where the one before ended."""
    from commands import cli

    code, out, err = cli(capsys, "plan", "--tp", "1", "--pp", "3", "--json")
    assert code == 0, err
    assert [(r["stage"], r["layers"]) for r in json.loads(out)["ranks"]] == [(0, [0, 2]), (1, [2, 3]), (2, [3, 4])]
    code, out, err = cli(capsys, "plan", "--tp", "1", "--pp", "3", "--pp-layers", "1,2,1")
    assert code == 0, err
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("rank ")] == [
        "rank 0 (stage 0, layers 0-0)", "rank 1 (stage 1, layers 1-2)", "rank 2 (stage 2, layers 3-3)"]


# --- 3. framing at the wire's room ---------------------------------------------------------------------------------


def pickled_to(size: int) -> bytes:
    """A bytes object whose pickle (as links.py pickles a result) is exactly `size` bytes."""
    for n in range(size, size - 32, -1):  # the opcode and length before the bytes: a few, by length
        blob = bytes(i % 251 for i in range(n))
        if len(pickle.dumps(blob, protocol=pickle.HIGHEST_PROTOCOL)) == size:
            return blob
    raise AssertionError(f"no bytes object pickles to {size} bytes")


def sent_and_received(sizes: list[int]) -> list[bytes] | None:
    """A pool task on 2 ranks: rank 0 sends each size's payload down the lockstep channel (Channel.send_raw), rank 1
    sends a result pickled to each size back up the links (Links.send_result); each side returns what it received."""
    import torch.distributed as dist

    from autotp.serve.lockstep.wire import Channel
    from autotp.serve.pipeline.links import EMPTY, Links

    rank = dist.get_rank()
    channel = Channel()
    links = Links(rank, 1 - rank if rank == 0 else None, 0 if rank == 1 else None, sampler=1)
    try:
        if rank == 0:
            inbox = links.listen(1, hops=False)
            for n in sizes:
                channel.send_raw(bytes((i * 7 + n) % 256 for i in range(n)))
            got = []
            while (item := inbox.get(10)) is not None:
                assert item is not EMPTY, "a result never came"
                got.append(item)
            return got
        got = [channel.recv_raw() for _ in sizes]
        for n in sizes:
            links.send_result(pickled_to(n))
        links.send_result(None)
        links.flush()
        return got
    finally:
        links.close()
        channel.close()


@pytest.mark.timeout(60)
def test_a_message_of_exactly_the_wires_room_and_one_byte_either_side_crosses_whole(pools):
    """wire.BUFFER less its length header is the room: a step or result of room - 1 and room bytes goes in one
    message, room + 1 in two; each arrives as sent, and the message after it too (a step read from a stale head
    would run the step before again, and its second message be taken for the next step's head)."""
    from autotp.serve.lockstep.wire import BUFFER, HEADER

    room = BUFFER - HEADER
    sizes = [room - 1, room, room + 1, 100, room, room + 1, room - 1, 40]
    up, down = pools(2).run(sent_and_received, sizes, timeout=30)
    assert [len(b) for b in down] == sizes
    assert down == [bytes((i * 7 + n) % 256 for i in range(n)) for n in sizes]
    assert up == [pickled_to(n) for n in sizes]


# --- 4. a stage's hidden states leave out the requests it passes over ----------------------------------------------


def first_chunk_fails_on_stage_0(model_dir: str, tokenizer_dir: str) -> list | None:
    """A pool task on 2 ranks (2 stages, a lane each): a 20-token prompt and a 3-token one arrive together; the first
    takes lane 0 and its first chunk the whole step (16 tokens), and stage 0's forward of it raises (as an
    out-of-memory error would). The next step, on its way before rank 0 learns of it, holds the long prompt's last
    4 tokens, then the short prompt: stage 0 passes the first over and hands on the short one's hidden states alone.
    A third row arrives later. Rank 0's end events: the long row, the short one, the later one."""
    armed = {"on": True}

    def raise_on_a_chunk(module, args, kwargs):
        if armed["on"] and kwargs.get("hidden_states", args[0] if args else None).shape[1] >= 12:
            armed["on"] = False
            raise RuntimeError("out of memory on stage 0")

    def hook(model) -> None:
        stage = model.autotp_stage
        if stage.stage == 0:
            model.transformer.h[stage.span.start].register_forward_pre_hook(raise_on_a_chunk, with_kwargs=True)

    def arrivals():
        long = [(7 * i) % 97 for i in range(20)]
        return {0: [job(long, 4, index=0), job([5, 6, 7], 12, index=1)], 10: [job([8, 9], 6, index=2)]}

    limits = Limits(max_num_seqs=4, max_num_batched_tokens=16, kv_tokens=10_000)
    ended = run_on_pipeline(model_dir, tokenizer_dir, arrivals, 2, limits, on_model=hook)
    return None if ended is None else [e for e, _ in ended]


@pytest.mark.timeout(120)
def test_a_chunk_that_fails_on_the_first_stage_fails_its_row_alone(pools, saved, tokenizer):
    """The issue's innocent request: it shares a step with the failed row's next chunk, after it, and is answered
    its tokens, not 500, because stage 0 tells stage 1 that its hidden states leave that chunk out."""
    failed, innocent, later = pools(2).run(first_chunk_fails_on_stage_0, saved(NAME), tokenizer.name_or_path,
                                           timeout=60)[0]
    assert (failed.status, failed.message) == (500, "generation failed: RuntimeError: out of memory on stage 0")
    model = any_model(NAME, LAYERS)
    for ended, ids, n in [(innocent, [5, 6, 7], 12), (later, [8, 9], 6)]:
        assert tokens_of(ended) == generate(model, torch.tensor([ids]), max_new_tokens=n)[0, len(ids):].tolist()


# --- 5. liveness: a rank whose beat stalls ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_rank_whose_beat_stalls_is_lost_and_one_that_beats_is_not(monkeypatch):
    """Rank 0's liveness against a real TCPStore: rank 1 beats (adds 1 to its counter) for a while, then stalls,
    as a host that lost power does. Rank 0 says nothing while rank 1 beats, and names it lost once it has not for
    LOST_S; reading a peer's counter must not move it (`add(key, 0)`), or a stalled host would never be found."""
    from autotp.parallel.stages import Stages
    from autotp.serve.pipeline import liveness

    monkeypatch.setattr(liveness, "BEAT_S", 0.1)
    monkeypatch.setattr(liveness, "LOST_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                                       wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    said: list[tuple[float, str]] = []
    lost = threading.Event()

    def on_lost(line: str) -> None:
        said.append((time.monotonic(), line))
        lost.set()

    watch = liveness.Liveness(0, Stages.split(2, 1, 2), "mutants", on_lost)
    beat = f"{watch.prefix}/beat/1"
    store.set(f"{watch.prefix}/host/1", "1\t4242\thost-b")  # node, pid, hostname, as a rank says them
    watch.start()
    try:
        beating_until = time.monotonic() + 2.5  # 2.5 LOST_S: it would have been lost by now without its beat
        while time.monotonic() < beating_until:
            store.add(beat, 1)
            time.sleep(0.1)
        stalled = time.monotonic()
        assert not said, said
        assert lost.wait(10), "a rank that stopped beating was never found lost"
        at, line = said[0]
        assert line.startswith("stage 1 (rank 1 on host-b) has not answered for "), line
        assert 0.5 <= at - stalled < 3.0, at - stalled
    finally:
        watch.stop()
        watch.join(5)
        del store
