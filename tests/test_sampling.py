"""The sampling rules `autotp generate` and `autotp serve` share (autotp.sampling), and the CLI applying them."""


import pytest
from commands import cli

from autotp.sampling.rules import SEED_MAX, SEED_MIN, SamplingError, check_sampling


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=2.0000001), "temperature"), (dict(temperature=-1e-300), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=2), "top_p"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_k=-1), "top_k"), (dict(seed=SEED_MAX + 1), "seed"),
    (dict(seed=SEED_MIN - 1), "seed"), (dict(max_tokens=0), "max_tokens"),
])
def test_out_of_range_values_name_their_parameter(kwargs, param):
    with pytest.raises(SamplingError) as e:
        check_sampling(**kwargs)
    assert e.value.param == param and str(e.value).startswith(f"{param} must be")


def test_temperatures_that_would_underflow_are_greedy():
    assert [check_sampling(temperature=t).temperature for t in (1e-40, 5e-324, 9.9e-6, 0.0)] == [0.0] * 4
    assert check_sampling(temperature=1e-5).temperature == 1e-5
    assert check_sampling(seed=SEED_MAX).seed == SEED_MAX and check_sampling(seed=SEED_MIN).seed == SEED_MIN


def test_the_cli_applies_the_same_rules_before_loading_anything(capsys):
    """The server refused top_p > 1 and the CLI sampled with it."""
    code, _, err = cli(capsys, "generate", "--model", "/nonexistent", "--prompt", "x", "--top-p", "2", "--do-sample")
    assert code == 2 and err.strip() == "autotp: error: --top-p must be in (0, 1], got 2.0", err
