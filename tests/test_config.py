"""gactx/config.py: levels, options and their validation."""

import pytest
import torch

import gactx
from gactx.config import LEVELS, make_config, parse_bytes


def test_levels_table():
    bits = {k: v["bits"] for k, v in LEVELS.items()}
    assert bits == {"L0": None, "L1": 4, "L1.1": 8, "L1.2": 2, "L2": 4, "L2.1": 3, "L2.2": 2, "L3": 4}
    assert make_config("L1.2").bits == 2 and make_config("L0").bits is None
    assert [make_config(level).adaptive for level in ("L1", "L2", "L2.1", "L2.2")] == [False, True, True, True]


def test_options_win_over_the_level():
    cfg = make_config("L1", bits=8, group_size=128)
    assert (cfg.level, cfg.bits, cfg.group_size) == ("L1", 8, 128)


def test_global_level_is_used_when_none_is_given():
    try:
        gactx.set_optimization_level("L1.2")
        assert gactx.get_optimization_level() == "L1.2"
        assert make_config().bits == 2
        assert make_config(bits=8).bits == 8
    finally:
        gactx.set_optimization_level("L1")


def test_l3_is_l2_with_offload():
    l2, l3 = make_config("L2"), make_config("L3")
    assert (l3.bits, l3.adaptive, l3.offload, l3.prefetch) == (l2.bits, True, True, 2)
    assert not l2.offload
    assert make_config("L1.2", offload=True).offload


@pytest.mark.parametrize(
    "options,match",
    [
        ({"bits": 3}, r"bits=3 is not allowed; allowed values are None or \(1, 2, 4, 8, 16, 32\)"),
        ({"group_size": 10}, "group_size=10 is not allowed"),
        ({"min_numel": -1}, "min_numel=-1"),
        ({"stochastic": "yes"}, "stochastic='yes' must be True or False"),
        ({"backend": "cuda"}, "backend='cuda' is not allowed"),
        ({"seed": -3}, "seed=-3"),
        ({"budget": "1GiB"}, "budget='1GiB' needs an adaptive level"),
        ({"offload": "yes"}, "offload='yes' must be True or False"),
        ({"prefetch": -1}, "prefetch=-1 must be a non-negative int"),
        ({"bits": 2.0}, r"bits=2.0 is not allowed"),  # a float that equals an allowed int is still a float
        ({"bits": True}, r"bits=True is not allowed"),
        ({"group_size": 256.0}, r"group_size=256.0 is not allowed"),
    ],
)
def test_bad_option_values_name_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        make_config("L1", **options)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"bits": 0.5}, "average width from 1 to 32"),
        ({"budget": "lots"}, "not a byte count"),
        ({"budget": -5}, "must not be negative"),
        ({"adapt_interval": 0}, "adapt_interval=0"),
        ({"probe_bits": 3}, r"probe_bits=3 is not allowed; allowed values are \(1, 2, 4, 8\)"),
        ({"strict": 1}, "strict=1 must be True or False"),
        ({"objective": "adam"}, r"objective='adam' is not allowed; allowed values are \('gradient', 'update'\)"),
        ({"probe_bits": 2.0}, r"probe_bits=2.0 is not allowed"),
        ({"bits": float("inf")}, "average width from 1 to 32"),
        ({"bits": float("nan")}, "average width from 1 to 32"),
        ({"budget": "infGiB"}, "not a byte count"),
        ({"budget": "nanMB"}, "not a byte count"),
        ({"budget": 1.5e9}, "not a byte count"),
    ],
)
def test_bad_adaptive_options_name_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        make_config("L2", **options)


def test_budgets_in_bits_or_bytes():
    assert make_config("L2", bits=2.5).bits == 2.5
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("512 MiB") == 1 << 29 and parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(4096) == 4096 and make_config("L2.2", budget="1.5GiB").budget == "1.5GiB"


def test_unknown_level_and_option():
    with pytest.raises(
        ValueError, match=r"unknown level 'L9'; available levels are \('L0', 'L1', 'L1.1', 'L1.2', 'L2'"
    ):
        make_config("L9")
    with pytest.raises(TypeError, match="unknown option"):
        make_config("L1", bitz=2)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        make_config("L1").bits = 2


def test_estimator_field():
    assert make_config("L2").estimator == "gact" and make_config("L2", estimator="actnn").estimator == "actnn"
    with pytest.raises(ValueError, match=r"estimator='free' is not allowed; allowed values are \('gact', 'actnn'\)"):
        make_config("L2", estimator="free")
    with pytest.raises(ValueError, match="estimator=None"):
        make_config("L2.2", estimator=None)


def test_the_default_schemes_follow_the_estimator():
    """GACT's estimator measures what a sketch adds; ActNN's does not, so its default offers none, and a sketch asked
    for under it is priced on its prediction alone: said, not refused."""
    import warnings

    assert make_config("L2.2").schemes == ("uniform", "normal", "sketch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_config("L2.2", estimator="actnn").schemes == ("uniform", "normal")
        assert make_config("L2.2", estimator="actnn", schemes=("uniform", "samples")).schemes == ("uniform", "samples")
        assert make_config("L1", estimator="actnn", schemes=("uniform", "sketch")).schemes == ("uniform", "sketch")
    with pytest.warns(RuntimeWarning, match="sketches are priced on their prediction alone") as caught:
        assert make_config("L2.2", estimator="actnn", schemes=("uniform", "sketch")).schemes == ("uniform", "sketch")
        gactx.Controller(torch.nn.Linear(4, 4), "L2.2", estimator="actnn", schemes=("uniform", "sketch"))
    assert [w.filename for w in caught] == [__file__, __file__]  # the caller's line, not gactx's
