"""llama.cpp's infill sampler (sampling/infill.py), which llama.vim puts in every request's chain: its three branches
on distributions worked by hand, the sampler's draw with it, and `/infill` through a 2-rank server against a plain
transcription of llama.cpp's loop on transformers' own scores, beside the same request without "infill"."""

from __future__ import annotations

import json
import math

import fim_model
import pytest
import torch
from serve_harness import Server
from test_serve_llama import VIM, post

from autotp import fim
from autotp.sampling import infill
from autotp.sampling.rules import SamplingParams
from autotp.sampling.sampler import RowSampler, sample
from autotp.serve.api import llama_api
from autotp.serve.api.boundary import Served

EOG = (90, 91)  # EOT first
PIECES = [b"a", b"b", b"c", b"re", b"return", b"zz", b"", b"d", b"e", b"f", b"g"] + [b""] * 80


def logits(ps: list[float]) -> list[float]:
    return [math.log(p) for p in ps]


# --- the rule on distributions worked by hand --------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_end_of_generation_wins_when_three_times_its_probability_times_the_candidates_outweighs_the_text():
    """4 candidates, text 0.9 - p_eog: EOG wins where 3 * p_eog * 4 > 0.9 - p_eog, p_eog > 1/13 (0.0769): at 0.1 only
    the EOG candidate stays (a factor 2 would need 1/9: a mutant 2 keeps text); at 0.07 the text branch runs."""
    assert infill.keep([0, 1, 2, 90], logits([0.5, 0.25, 0.15, 0.1]), EOG, PIECES) == [90]
    # 0.07: text; keep >= 0.2: a 0.6, b 0.25, EOG; renormalised by 0.92: b 0.272 < 1/3 (two texts left): dropped
    assert infill.keep([0, 1, 2, 90], logits([0.6, 0.25, 0.08, 0.07]), EOG, PIECES) == [0, 90]


@pytest.mark.timeout(10)
def test_after_the_first_cut_text_below_one_over_texts_plus_one_goes():
    """0.5, 0.35, 0.1 and EOG 0.05 (3 * 0.05 * 4 = 0.6 < 0.95): 0.1 < 0.2 goes; renormalised by 0.9 b is 0.389 >= 1/3,
    kept (a mutant 1/texts, 0.5, drops it), and the EOG stays whatever its probability."""
    assert infill.keep([0, 1, 2, 90], logits([0.5, 0.35, 0.1, 0.05]), EOG, PIECES) == [0, 1, 90]


@pytest.mark.timeout(10)
def test_a_token_that_is_a_prefix_of_another_takes_its_probability_or_gives_its_own_to_the_likelier():
    """'re' 0.18 and 'return' 0.17 are each below 0.2, 'c' 0.5, 'zz' 0.14, EOG 0.01 (text branch): merged, 're' holds
    0.35 and stays (0.35 / 0.86 = 0.407 >= 1/3); the likelier of the two takes the pair, 'return' where it is the
    likelier. Without the merge (a mutant) both go: [c, EOG]; always into the shorter one (a mutant): 're' in both."""
    ids = [2, 3, 4, 5, 90]  # c, re, return, zz, EOG
    assert infill.keep(ids, logits([0.5, 0.18, 0.17, 0.14, 0.01]), EOG, PIECES) == [2, 3, 90]
    assert infill.keep(ids, logits([0.5, 0.17, 0.18, 0.14, 0.01]), EOG, PIECES) == [2, 4, 90]


@pytest.mark.timeout(10)
def test_a_token_without_text_merges_with_none_and_candidates_arrive_in_any_order():
    """'a' 0.44, a special token (no text, id 6) 0.28, 'c' 0.27, EOG 0.01: no pair merges, all three texts pass both
    cuts (>= 0.2, then >= 1/4). Were an empty text a prefix of every text (a mutant), 'a' would take the special
    token's share. The candidates' order in does not matter: they are ranked by score."""
    assert infill.keep([6, 2, 0, 90], logits([0.28, 0.27, 0.44, 0.01]), EOG, PIECES) == [0, 6, 2, 90]
    assert infill.keep([90, 2, 0, 6], logits([0.01, 0.27, 0.44, 0.28]), EOG, PIECES) == [0, 6, 2, 90]


@pytest.mark.timeout(10)
def test_when_no_text_survives_the_first_cut_the_row_ends_with_eot_alone():
    """Ten texts of 0.099 and EOG 0.01 (3 * 0.01 * 11 = 0.33 < 0.99: text branch): none reaches 0.2, so EOT (EOG's
    first, 90, not even a candidate) alone; EOG's other id (91) is a candidate and is not what ends it."""
    ids = [0, 1, 2, 7, 8, 9, 10, 20, 21, 22, 91]
    assert infill.keep(ids, logits([0.099] * 10 + [0.01]), EOG, PIECES) == [90]


@pytest.mark.timeout(10)
def test_the_sampler_draws_only_from_what_infill_keeps_and_greedy_takes_its_likeliest():
    """scores over 12 ids, EOT 11: c, re, return, zz as above. A greedy row without infill takes c (argmax); with it,
    c too; where every text is below 0.2 greedy ends with EOT though a text is the argmax. Sampling rows (20 seeds)
    draw only c or re (EOG's logit is tiny), never return or zz; without infill, return and zz come up."""
    pieces = PIECES[:11] + [b""]
    scores = torch.full((12,), -30.0)
    scores[[2, 3, 4, 5, 11]] = torch.tensor(logits([0.5, 0.18, 0.17, 0.14, 0.01]))
    flat = torch.full((12,), -30.0)
    flat[:10], flat[11] = math.log(0.099), math.log(0.01)
    flat[3] += 0.01  # the argmax is a text token
    on = SamplingParams(temperature=0.0, infill=(11,))
    assert sample([RowSampler(on, pieces=pieces)], scores[None]) == [2]
    assert sample([RowSampler(on, pieces=pieces), RowSampler(SamplingParams())], torch.stack([flat, flat])) == [11, 3]
    drawn = {sample([RowSampler(SamplingParams(1.0, seed=s, infill=(11,)), pieces=pieces)], scores[None])[0]
             for s in range(20)}
    plain = {sample([RowSampler(SamplingParams(1.0, seed=s))], scores[None])[0] for s in range(20)}
    assert drawn <= {2, 3, 11} and 2 in drawn and 3 in drawn
    assert plain & {4, 5}


@pytest.mark.timeout(10)
def test_after_a_temperature_in_the_chain_infill_decides_on_the_scaled_probabilities():
    """Three texts of 0.3 and EOG 0.1: at temperature 1 EOG wins (3 * 0.1 * 4 > 0.9), so a row whose chain puts
    temperature after infill only ever ends; at 0.5 (temperature first in the chain) the squares, 0.09 each and 0.01,
    give EOG 0.036 (0.43 < 0.96): the texts stay, and are drawn."""
    scores = torch.tensor(logits([0.3, 0.3, 0.3, 0.1]))
    pieces = [b"a", b"b", b"c", b""]
    after = {sample([RowSampler(SamplingParams(0.5, seed=s, infill=(3,)), pieces=pieces)], scores[None])[0]
             for s in range(10)}
    first = {sample([RowSampler(SamplingParams(0.5, seed=s, infill=(3,), infill_scaled=True), pieces=pieces)],
                    scores[None])[0] for s in range(10)}
    assert after == {3} and first & {0, 1, 2}


@pytest.mark.timeout(30)
def test_the_chain_says_where_infill_applies_and_what_it_sees(tmp_path):
    """llama.vim's chain: infill with the eos (EOT) first, then the FIM sentinels, on temperature-1 probabilities;
    temperature before infill: on the scaled ones, and none at all where a greedy temperature or a top-p of 0 before
    it leaves it one candidate (which it keeps); after infill, greedy keeps it; a chain without it, none."""
    tok = fim_model.tokenizer(tmp_path)
    served = Served("m", tok, CONTEXT, 0, 10**6, len(tok))
    eog = (tok.eos_token_id, *fim.stop_ids(tok))

    def row(**body):
        base = {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 4}
        (r,) = llama_api.parse_infill(json.dumps(base | body).encode(), served).rows
        return r.infill, r.infill_scaled

    assert row(samplers=["top_k", "top_p", "infill"]) == (eog, False) and eog[0] == tok.eos_token_id
    assert row(samplers="kpi") == (eog, False)  # the chain as letters
    assert row(samplers=["temperature", "infill"], temperature=0.5) == (eog, True)
    assert row(samplers=["temperature", "infill"], temperature=0.0) == ((), False)
    assert row(samplers=["top_p", "infill"], top_p=0.0) == ((), False)
    assert row(samplers=["infill", "top_p"], top_p=0.0) == (eog, False)
    assert row(samplers=["infill", "temperature"], temperature=0.0) == (eog, False)
    assert row(samplers=["top_k", "top_p"]) == ((), False)
    assert row() == ((), False)  # llama-server's default chain has no infill


@pytest.mark.timeout(30)
def test_token_texts_are_the_bytes_each_id_decodes_to_and_special_tokens_have_none(tmp_path):
    tok = fim_model.tokenizer(tmp_path)
    pieces = infill.token_bytes(tok)
    assert len(pieces) == len(tok)
    for i in range(len(tok)):
        if i in tok.all_special_ids:
            assert pieces[i] == b""
        else:
            assert pieces[i] == tok.decode([i]).encode() or b"\xef\xbf\xbd" in tok.decode([i]).encode()
    assert any(p.startswith(b" ") for p in pieces)  # byte-level's 'Ġ' is a space
    assert any(p.startswith(b"\n") for p in pieces)  # and 'Ċ' a newline


class SentencePiece:
    """What token_bytes reads of a SentencePiece tokenizer (Llama's, CodeLlama's): U+2581 a space, <0x0A> a byte."""

    all_special_ids = [0]
    added_tokens_decoder: dict = {}
    tokens = ["<s>", "\u2581def", "<0x0A>", "\u00e9", "ab"]

    def __len__(self):
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]


@pytest.mark.timeout(10)
def test_sentencepiece_texts_are_utf8_with_spaces_and_raw_bytes():
    """An e with an acute accent is UTF-8's two bytes here (a byte-level vocabulary would make it the byte 0xE9)."""
    assert infill.token_bytes(SentencePiece()) == [b"", b" def", b"\n", b"\xc3\xa9", b"ab"]


# --- through the server --------------------------------------------------------------------------------------------

CONTEXT = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return fim_model.build(tmp_path_factory.mktemp("fim"), n_positions=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve") / "server.log")  # 2 ranks
    yield s
    s.kill()


def llama_cpp_infill(cands: list[dict], eog: set[int], eot: int, text) -> list[int]:
    """llama_sampler_infill_apply as llama.cpp writes it, loop for loop, on [{id, logit}] sorted likeliest first ->
    the ids left with a finite logit (what its dist sampler can draw)."""
    m = cands[0]["logit"]
    ex = [math.exp(c["logit"] - m) for c in cands]
    for c, e in zip(cands, ex, strict=True):
        c["p"] = e / sum(ex)
    p_txt = sum(c["p"] for c in cands if c["id"] not in eog)
    p_eog = sum(c["p"] for c in cands if c["id"] in eog)
    if 3 * p_eog * len(cands) > p_txt:
        return [c["id"] for c in cands if c["id"] in eog]
    for i0 in range(len(cands)):
        for i1 in range(len(cands)):
            if cands[i0]["logit"] == -math.inf:
                break
            if i0 == i1 or cands[i1]["logit"] == -math.inf:
                continue
            t0, t1 = text(cands[i0]["id"]), text(cands[i1]["id"])
            if len(t0) > 0 and len(t0) <= len(t1) and t1[:len(t0)] == t0:
                dst, src = (i1, i0) if cands[i1]["p"] > cands[i0]["p"] else (i0, i1)
                cands[dst]["p"] += cands[src]["p"]
                cands[src]["logit"], cands[src]["p"] = -math.inf, 0.0
    kept = [c for c in cands if c["p"] >= 0.2 or c["id"] in eog]
    n_txt = sum(c["id"] not in eog for c in kept)
    if n_txt == 0:
        return [eot]
    total = sum(c["p"] for c in kept)
    kept = [c for c in kept if c["p"] / total >= 1 / (n_txt + 1) or c["id"] in eog]
    return [c["id"] for c in kept if c["logit"] != -math.inf]


def oracle(model_dir: str, ids: list[int], n: int, top_k: int, top_p: float) -> list[int]:
    """Greedy through llama.cpp's chain top-k, top-p, infill, temperature 0 on transformers' scores; ends at EOG."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eog = {tok.eos_token_id, *fim.stop_ids(tok)}
    texts = infill.token_bytes(tok)  # checked on its own above
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            scores = model(torch.tensor([ids + out])).logits[0, -1]
            values, order = scores.topk(top_k)
            probs = values.softmax(-1)
            cut = int((probs.cumsum(-1) < top_p).sum()) + 1  # through the token that reaches top_p
            cands = [{"id": int(i), "logit": float(v)} for i, v in zip(order[:cut], values[:cut], strict=True)]
            kept = llama_cpp_infill(cands, eog, tok.eos_token_id,
                                    lambda i: texts[i])
            out.append(kept[0])
            if kept[0] in eog:
                break
    return out


@pytest.mark.timeout(120)
def test_infill_in_the_chain_ends_the_middle_where_llama_cpp_would_and_without_it_the_row_writes_on(server,
                                                                                                    model_dir):
    """llama.vim's request (top_k 40, top_p 0.9, "infill"), greedy (temperature last in the chain, 0), no deadline:
    the server's tokens are llama.cpp's loop on transformers' scores, to its end of generation; without "infill" in
    the chain the same request writes on to n_predict."""
    body = json.loads(VIM["requests"][3]["body"]) | {"samplers": ["top_k", "top_p", "infill", "temperature"],
                                                      "temperature": 0.0, "n_predict": 24, "t_max_predict_ms": 0,
                                                      "return_tokens": True, "response_fields": []}
    status, answer = post(server, "/infill", body)
    assert status == 200, answer
    got = json.loads(answer)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    served = Served(server.model_id, tok, CONTEXT, 0, 10**6, len(tok))
    (row,) = llama_api.parse_infill(json.dumps(body).encode(), served).rows
    want = oracle(model_dir, list(row.ids), 24, 40, 0.9)
    assert got["stop_type"] == "eos" and len(want) < 24, (got, want)
    assert got["tokens"] == want  # the end token included, as llama-server's tokens are
    status, answer = post(server, "/infill", body | {"samplers": ["top_k", "top_p", "temperature"]})
    plain = json.loads(answer)
    assert status == 200 and plain["stop_type"] == "limit" and plain["tokens_predicted"] == 24, plain
