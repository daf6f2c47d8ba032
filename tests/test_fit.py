"""`autotp plan --devices`: the layout, layer split and weight form autotp.fit chooses from each GPU's memory.

The StarCoder cases are worked by hand from `autotp plan`'s figures for examples/starcoder (config only), in GiB =
2**30 bytes, each device less fit.MARGIN (1 GiB), the KV reserve the config's 8192 positions x 1 sequence:
  bf16, tp 1: a decoder layer 758256128 B (0.7062 GiB), its KV 512 B a token (one KV head of 128, keys and values,
  2 bytes): 4 MiB for 8192 tokens; wte + wpe (first stage only) 704643072 B, the tied head (last only) 603979776 B,
  ln_f (every stage) 24576 B.
  int8, tp 2: a layer 190477312 B per rank, first 402653184, last 301989888, every 24576; KV as at tp 1 (the one KV
  head is on both ranks).
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
from commands import autotp, cli, error_lines
from families import FAMILIES, config

from autotp import fit
from autotp.cli import device_sizes
from autotp.errors import AutotpError
from autotp.report import plan_report

G = 2**30
STARCODER = Path(__file__).resolve().parents[1] / "examples" / "starcoder"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def starcoder():
    return fit.measure(str(STARCODER), 128, "cuda")


def agrees_with_plan(chosen: fit.Fit, model: str) -> None:
    """Each stage's bytes per rank are what `autotp plan --tp T --pp P --pp-layers ...` says that rank holds."""
    report = plan_report(model, chosen.tp, None, chosen.quantize, device_type="cuda", pp=chosen.pp,
                         pp_layers=chosen.pp_layers if chosen.pp > 1 else None)
    assert report["dtype"] == chosen.dtype
    for r in report["ranks"]:
        stage = chosen.stages[r["stage"]]
        assert r["total_bytes"] == stage.weights[r["rank"] % chosen.tp]
        assert r["kv_bytes_per_token"] * chosen.kv_tokens == stage.kv[r["rank"] % chosen.tp]
        assert [stage.layers.start, stage.layers.stop] == r["layers"]


def test_24_and_12_on_one_host_and_8_on_another_split_in_proportion_to_memory(starcoder):
    """A stage per GPU (24 and 12 differ; hosts are stages), layers in proportion to the room each has in layers of
    0.7062 + 0.0039 GiB (weights + KV): stage 0: (23 - 0.6563 wte/wpe/ln_f) / 0.7101 = 31.47; stage 1: 11 / 0.7101
    = 15.49; stage 2: (7 - 0.5625 head/ln_f) / 0.7101 = 9.07. Of 40 layers: 22.47, 11.06, 6.47; floors 22, 11, 6;
    the one left goes to the largest remainder, stage 2 (0.4729 against stage 0's 0.4666): 22, 11, 7. An even split
    (14, 13, 13) puts 13 x 0.7062 + 0.5625 = 9.74 GiB on the 8 GiB card."""
    chosen = fit.fit([[24 * G, 12 * G], [8 * G]], 40, starcoder, 8192)
    assert (chosen.tp, chosen.pp, chosen.pp_layers, chosen.dtype, chosen.quantize) == (1, 3, (22, 11, 7),
                                                                                       "bfloat16", None)
    assert [(s.host, s.devices) for s in chosen.stages] == [(0, (0,)), (0, (1,)), (1, (0,))]
    agrees_with_plan(chosen, str(STARCODER))
    assert chosen.lines()[3] == "stage 2 on host 1 (cuda:0): layers 33-39, 5.51 GiB + 0.03 GiB KV of 7.00 GiB, bfloat16"


def test_four_8_gib_cards_on_two_hosts_take_int8_at_tp_2(starcoder):
    """bf16 at tp 2 pp 2 (alike cards: tp inside each host): a stage-0 rank holds 0.375 + 20 x 0.3546 = 7.47 GiB +
    0.08 GiB KV > 7; a stage per GPU holds the whole 28.90 + 0.56 (the tied head again) > 4 x 7. int8 at tp 2: rooms
    (7 - 0.375) / 0.1813 = 36.54 and (7 - 0.281) / 0.1813 = 37.06 layers: 19.86 and 20.14 of 40, floors 19 and 20,
    the remainder to stage 0: 20, 20."""
    chosen = fit.fit([[8 * G, 8 * G], [8 * G, 8 * G]], 40, starcoder, 8192)
    assert (chosen.tp, chosen.pp, chosen.pp_layers, chosen.quantize) == (2, 2, (20, 20), "int8")
    assert [(s.host, s.devices) for s in chosen.stages] == [(0, (0, 1)), (1, (0, 1))]
    agrees_with_plan(chosen, str(STARCODER))
    assert fit.commands(chosen, "M", [2, 2], None, 128) == [
        f"host {h}: torchrun --nnodes 2 --node-rank {h} --nproc-per-node 2 --master-addr HOST0_ADDRESS "
        "--master-port 29500 -m autotp serve --model M --tp 2 --pp 2 --pp-layers 20,20 --quantize int8"
        for h in (0, 1)]


def test_a_fixed_dtype_that_cannot_fit_is_refused_with_the_numbers_and_what_fits(starcoder):
    """--dtype bfloat16 on 4 x 8 GiB: the weights of tp 2 pp 2 (every rank's, the embedding on stage 0 and the head
    on stage 1), the KV reserve of every rank, the devices' room, and int8's room left after its weights."""
    bf16 = plan_report(str(STARCODER), 2, "bfloat16", device_type="cuda", pp=2, pp_layers=(20, 20))["ranks"]
    int8 = plan_report(str(STARCODER), 2, None, "int8", device_type="cuda", pp=2, pp_layers=(20, 20))["ranks"]
    weights = sum(r["total_bytes"] for r in bf16) / G
    kv = sum(r["kv_bytes_per_token"] for r in bf16) * 8192 / G
    free = (4 * 7 * G - sum(r["total_bytes"] for r in int8)) / G
    with pytest.raises(AutotpError) as e:
        fit.fit([[8 * G, 8 * G], [8 * G, 8 * G]], 40, starcoder, 8192, dtype="bfloat16")
    assert str(e.value) == (f"bfloat16 needs {weights:.2f} GiB of weights + {kv:.2f} GiB KV (8192 tokens) at tp 2 "
                            "pp 2; the 4 devices hold 28.00 GiB (1.00 GiB kept free on each): int8 fits "
                            f"(--quantize int8 --tp 2) with {free:.2f} GiB for the KV cache")
    assert (weights, kv) == (pytest.approx(29.68, abs=0.01), pytest.approx(0.31, abs=0.01))


def test_what_the_user_gave_is_kept(starcoder):
    """--quantize int4 where bf16 fits stays int4; --tp 1 where tp 2 is preferred stays tp 1 (a stage per card);
    --pp-layers are checked as given, and refused where a stage does not fit."""
    kept = fit.fit([[24 * G, 12 * G], [8 * G]], 40, starcoder, 8192, quantize="int4")
    assert (kept.quantize, kept.pp) == ("int4", 3)
    agrees_with_plan(kept, str(STARCODER))
    one = fit.fit([[8 * G, 8 * G], [8 * G, 8 * G]], 40, starcoder, 8192, tp=1, quantize="int8")
    assert (one.tp, one.pp, one.pp_layers) == (1, 4, (10, 10, 10, 10))
    with pytest.raises(AutotpError, match=r"^--pp 2 does not match the devices: 3 GPUs on 2 host\(s\) make 3 stages$"):
        fit.fit([[24 * G, 12 * G], [8 * G]], 40, starcoder, 8192, pp=2)
    given = fit.fit([[24 * G, 12 * G], [8 * G]], 40, starcoder, 8192, pp=3, pp_layers=(20, 12, 8))
    assert given.pp_layers == (20, 12, 8)
    with pytest.raises(AutotpError, match=r"stage 2 on host 1 \(cuda:0\): layers 26-39, 10\.45 GiB .* of 7\.00 GiB, "
                                          "bfloat16 does not fit"):
        fit.fit([[24 * G, 12 * G], [8 * G]], 40, starcoder, 8192, pp=3, pp_layers=(14, 12, 14), dtype="bfloat16")
    # int8 on 8 + 4 GiB: 14.8 GiB of weights in 7 + 3: refused, int4 named
    with pytest.raises(AutotpError, match=r"^bfloat16 with int8 linear weights needs 15\.\d\d GiB .*: int4 fits "
                                          r"\(--quantize int4 --tp 1\)"):
        fit.fit([[8 * G], [4 * G]], 40, starcoder, 8192, quantize="int8")


def test_hosts_with_different_gpu_counts_run_a_stage_per_gpu_or_are_refused(starcoder):
    """2 GPUs on one host, 1 on the other: tp 2 on the first and 1 on the second would be stages of different tp,
    which the engine cannot run (world = pp x tp): a stage per GPU, said in the plan; --tp 2 is refused."""
    chosen = fit.fit([[24 * G, 24 * G], [24 * G]], 40, starcoder, 8192)
    assert (chosen.tp, chosen.pp, chosen.pp_layers) == (1, 3, (13, 14, 13))
    assert "a stage per GPU: hosts of 2 and 1 GPUs, and every stage runs at one tp" in chosen.lines()[0]
    with pytest.raises(AutotpError) as e:
        fit.fit([[24 * G, 24 * G], [24 * G]], 40, starcoder, 8192, tp=2)
    assert str(e.value) == ("--tp 2 does not divide the hosts' GPUs (2 and 1): a stage's ranks stay on one host and "
                            "every stage runs at one tp (world = pp x tp); --tp 1 --pp 3 (a stage per GPU) is the "
                            "layout these hosts allow")


def test_alike_cards_share_a_stage_and_unlike_ones_do_not():
    assert [t for t, _ in fit.layouts([[8, 8], [8, 8]], None)] == [2, 1]
    assert [t for t, _ in fit.layouts([[8, 8, 4, 4]], None)] == [2, 1]
    assert [t for t, _ in fit.layouts([[8, 4, 8, 4]], None)] == [1]
    assert [t for t, _ in fit.layouts([[24, 12]], None)] == [1]
    assert fit.layouts([[8, 8, 4, 4]], None)[0][1] == [(0, (0, 1)), (0, (2, 3))]


def synthetic(layers: int) -> fit.Costs:
    """1 GiB a layer, nothing else, at tp 1."""
    return fit.Costs("bfloat16", None, 1, ((G,) * layers,), (0,), (0,), (0,), (layers * G,), (0,))


def test_a_rounding_that_overflows_a_stage_is_repaired():
    """Rooms 1.95 and 3 layers for 4 layers: quotas 1.58 and 2.42, the remainder to stage 0 gives 2 layers to a
    stage that holds 1.95; one moves to stage 1: 1, 3. Rooms under one layer, or fewer layers than stages: none."""
    hosts = [[fit.MARGIN + int(1.95 * G)], [fit.MARGIN + 3 * G]]
    chosen = fit.fit(hosts, 4, lambda d, q, t, pp: synthetic(4), 0)
    assert chosen.pp_layers == (1, 3)
    assert fit.split(4, [1.95, 3.0], lambda counts: None) == [2, 2]
    assert fit.split(4, [0.99, 5.0], lambda counts: None) is None
    assert fit.split(1, [3.0, 3.0], lambda counts: None) is None
    with pytest.raises(AutotpError) as e:  # 5.5 GiB of room for 4 GiB, but not where a stage can use it
        fit.fit([[fit.MARGIN + int(0.95 * G)], [fit.MARGIN + int(4.55 * G)]], 4, lambda d, q, t, pp: synthetic(4), 0)
    assert str(e.value) == ("bfloat16 needs 4.00 GiB of weights + 0.00 GiB KV (0 tokens) at tp 1 pp 2; the 2 devices "
                            "hold 5.50 GiB (1.00 GiB kept free on each), but stage 0 holds 0.9 layers after its fixed "
                            "costs: no weight form fits (int4 is the smallest)")


def test_the_margin_and_the_kv_reserve_count():
    """4 layers of 1 GiB on one card of MARGIN + 4 GiB fits with no KV; 1 byte less, or a KV reserve, does not."""
    measure = lambda d, q, t, pp: synthetic(4)  # noqa: E731
    assert fit.fit([[fit.MARGIN + 4 * G]], 4, measure, 0).pp == 1
    with pytest.raises(AutotpError):
        fit.fit([[fit.MARGIN + 4 * G - 1]], 4, measure, 0)
    costs = dataclasses.replace(synthetic(4), kv=(1,))
    with pytest.raises(AutotpError):
        fit.fit([[fit.MARGIN + 4 * G]], 4, lambda d, q, t, pp: costs, 4)


def test_every_familys_fit_agrees_with_its_plan_byte_for_byte(tmp_path):
    """Each family's 4-layer config on 2 hosts of 2 cards sized to a third of its tp-1 weights each: tp 2 (uneven
    heads on some ranks), pp 2, and the bytes `autotp plan` gives that layout, rank by rank."""
    for name in FAMILIES:
        directory = tmp_path / name
        config(name, num_hidden_layers=4).save_pretrained(directory)
        measure = fit.measure(str(directory), 128, "cuda")
        card = fit.MARGIN + sum(measure(None, None, 1, 1).whole) // 3
        chosen = fit.fit([[card, card], [card, card]], 4, measure, 16)
        assert (chosen.tp, chosen.pp) == (2, 2), name
        agrees_with_plan(chosen, str(directory))


def test_plan_devices_from_the_command_line(capsys):
    code, out, err = cli(capsys, "plan", "--model", str(STARCODER), "--devices", "24GiB,12GiB", "--devices", "8G")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{STARCODER}: tp=1 pp=3 layers 22,11,7, bfloat16; KV reserve 8192 tokens")
    assert lines[2] == "stage 1 on host 0 (cuda:1): layers 22-32, 7.77 GiB + 0.04 GiB KV of 11.00 GiB, bfloat16"
    assert lines[6].endswith("-m autotp serve --model " + str(STARCODER) + " --tp 1 --pp 3 --pp-layers 22,11,7")
    assert re.match(r"host 0: torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 ", lines[5])
    assert re.match(r"host 1: torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 ", lines[6])
    assert device_sizes("7.5GiB, 8g,8G,4096") == [int(7.5 * G), 8 * G, 8 * G, 4096]
    code, out, _ = cli(capsys, "plan", "--model", str(STARCODER), "--devices", "40GiB", "--json", "--kv-tokens", "100")
    data = json.loads(out)
    assert (data["tp"], data["pp"], data["kv_tokens"], data["commands"]) == (
        1, 1, 100, [f"autotp serve --model {STARCODER} --tp 1"])
    code, _, err = cli(capsys, "plan", "--model", str(STARCODER))
    assert (code, err) == (2, "autotp: error: autotp plan needs --tp N, or --devices to choose it\n")


def test_plan_devices_that_hold_nothing_exits_2_with_one_line():
    out = autotp("plan", "--model", str(STARCODER), "--devices", "4GiB", "--devices", "2GiB")
    assert out.returncode == 2 and out.stdout == ""
    assert len(error_lines(out.stderr)) == 1 and out.stderr.count("\n") == 1, out.stderr
    weights = sum(r["total_bytes"] for r in plan_report(str(STARCODER), 1, pp=2, pp_layers=(20, 20))["ranks"])
    assert out.stderr == (f"autotp: error: bfloat16 needs {weights / G:.2f} GiB of weights + 0.16 GiB KV (8192 tokens) "
                          "at tp 1 pp 2; the 2 devices hold 4.00 GiB (1.00 GiB kept free on each): no weight form "
                          "fits (int4 is the smallest)\n")
