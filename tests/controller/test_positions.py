"""gactx/controller/positions.py: a followed pass's saves and module calls, as keys by position read them."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gactx
from gactx.controller.identity import Key
from gactx.controller.positions import Trace, call_site, passes_saves_on


def _site_of_an_op():
    @passes_saves_on
    def hook():  # what the pack hook's path is to the call site: a marked frame
        return call_site()

    return hook(), _site_of_an_op.__code__


def test_the_call_site_is_the_first_frame_above_the_marked_ones():
    (code, instruction), here = _site_of_an_op()
    assert code is here and instruction >= 0


def test_a_recorded_pass_is_the_one_to_repeat_and_tells_whether_it_repeated_the_last():
    t = torch.randn(4, 4, requires_grad=True).exp()  # made by exp: its node ExpBackward0
    trace, key, site = Trace(), Key("a", 1, 0, (4, 4)), (None, 3)
    for repeated in (False, True):
        trace.begin()
        trace.entered("a")
        trace.saved(key, t, site)
        trace.returned()
        assert trace.end() is repeated
    trace.begin()
    assert trace.end() is None and len(trace) == 1, "a pass that saved nothing changes nothing"
    assert trace.at(0, t, site)[0] == key
    assert trace.at(0, t, (None, 4)) is None, "another call site"
    assert trace.at(0, t.t().contiguous(), site) is None, "another node"
    assert trace.at(0, t.detach().exp().requires_grad_().exp(), site) is not None, "the same shape, dtype and node"
    assert trace.at(0, t.double(), site) is None and trace.at(0, t[:2], site) is None and trace.at(1, t, site) is None


def test_the_calls_at_a_save_are_those_of_the_pass_up_to_it():
    """root enters, a saves twice (its second call once), a returns, b saves: the stack and calls at each save."""
    t, trace = torch.randn(2).exp(), Trace()
    trace.begin()
    trace.entered("")
    for call in (1, 2):
        trace.entered("a")
        trace.saved(Key("a", call, 0, (2,)), t, (None, 0))
        trace.returned()
    trace.entered("b")
    trace.saved(Key("b", 1, 0, (2,)), t, (None, 1))
    trace.returned()
    trace.returned()
    trace.end()
    modules = {"": torch.nn.Module(), "a": torch.nn.Module(), "b": torch.nn.Module()}
    stack, calls = trace.calls_at(2, modules)
    assert [(f[0], f[1], f[2]) for f in stack] == [("", 1, 0), ("a", 2, 1)] and calls == {"": 1, "a": 2}
    assert stack[1][3] is modules["a"] and stack[1][4], "rebuilt: its return unseen"
    stack, calls = trace.calls_at(3, modules)
    assert [f[0] for f in stack] == ["", "b"] and calls == {"": 1, "a": 2, "b": 1}
    assert trace.calls_at(0, modules) == ([], {})


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(24, 24), nn.GELU()), nn.Linear(24, 24)

    def forward(self, x):
        return self.b(checkpoint(self.a, x, use_reentrant=False))


def test_a_call_site_stays_the_same_once_its_code_is_specialized():
    """Python 3.11 specializes a frame's code after a few runs; a call it specializes is made by its PRECALL, read as
    the CALL after it (positions.PRECALL). torch's non-reentrant checkpoint saves its inputs from a list comprehension
    whose call is specialized in the first passes: keys by position must not diverge there."""
    model = Checkpointed()
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(12):
            model(torch.randn(8, 24)).sum().backward()
        diagnostics = controller.diagnostics()
    assert diagnostics["keys_by_position"] and diagnostics["divergences"] == 0
