"""gactx/controller/pack.py: the path of one saved tensor is short. Followed through pack in eager mode (the input of
a linear layer at L1, an unwatched pass, not the pass's first save), it leaves the pack path for one module at a
time (the policy, the keys, the pass's statistics, the learned sites, the decision, the store) and never calls up into
the Controller; in the passes after, the same save is replayed (replay.py): the policy, the key (by position once
passes repeat: identity.py), the replay. Followed is the Python path: the C++ lane (lane.py), which takes the
replayed saves of passes by position where it serves, is off (test_lane.py holds it to the Python path).
"""

import sys

import torch
from torch import nn

import gactx
from gactx.controller import identity, lane
from gactx.controller.pack import PackPath

HUB = "controller/pack.py"


def _follow_one_save(monkeypatch, before: int) -> list[tuple[str, str]]:
    """``(file, function)`` of each call that pack.py makes into another gactx file while packing the second
    layer's input in the pass after ``before`` passes (the first watched), nested calls left out (they belong to the
    call that made them)."""
    calls, state = [], {"n": -1, "on": False}
    monkeypatch.setattr(lane, "NATIVE", False)

    def tracer(frame, event, arg):
        if event == "call" and "/gactx/" in frame.f_code.co_filename:
            here = frame.f_code.co_filename.split("/gactx/")[1]
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if here != HUB and caller.endswith(HUB):
                calls.append((here, frame.f_code.co_name))

    original = PackPath.pack

    @identity.passes_saves_on  # a frame between autograd and the tracker: no call site (keys by position check those)
    def pack(self, t):
        state["n"] += 1
        if not (state["on"] and state["n"] == 2):  # saves: input 0, weight (kept), input 1
            return original(self, t)
        sys.setprofile(tracer)
        try:
            return original(self, t)
        finally:
            sys.setprofile(None)

    monkeypatch.setattr(PackPath, "pack", pack)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
    x = torch.randn(64, 64)
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(before):
            model(x).sum().backward()
        state["n"], state["on"] = -1, True
        model(x).sum().backward()
    assert controller.records, "the pass was recorded"
    return calls


def test_one_save_visits_each_part_once_and_never_the_controller(monkeypatch):
    calls = _follow_one_save(monkeypatch, before=1)  # the first unwatched pass: the whole path
    modules = [f for f, _ in calls]
    rooms = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]  # consecutive calls: one stop
    assert rooms == [
        "controller/policy.py",  # a parameter?
        "controller/identity.py",  # its key (no replay of it yet)
        "controller/policy.py",  # layout, dtype, size
        "controller/identity.py",  # its slot
        "controller/stats.py",  # is its storage kept as it is already
        "controller/sites.py",  # its op, as learned in the watched pass
        "controller/decide.py",  # width, scheme, seed (from the plan)
        "controller/product.py",  # not the product of two stored saves
        "controller/store.py",  # encoded (the kernels, nested)
        "controller/stats.py",  # recorded
        "controller/replay.py",  # kept for the next pass to replay
        "controller/store.py",  # the handle
        "controller/product.py",  # remembered, for a product of it to find
    ], calls
    assert "controller/controller.py" not in modules


def test_the_same_save_in_a_later_pass_is_replayed_in_three_stops(monkeypatch):
    """Keys by position (identity.py: from the third pass, two passes having saved the same): the policy, the save at
    its position, the record; with every module call followed, the policy, the key, the replay (its record nested)."""
    calls = _follow_one_save(monkeypatch, before=3)
    modules = [f for f, _ in calls]
    rooms = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert rooms == ["controller/policy.py", "controller/identity.py", "controller/stats.py"], calls
    assert ("controller/identity.py", "at_position") in calls

    monkeypatch.setattr(identity, "MAX_DIVERGENCES", 0)  # keys never by position
    calls = _follow_one_save(monkeypatch, before=3)
    modules = [f for f, _ in calls]
    rooms = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert rooms == ["controller/policy.py", "controller/identity.py", "controller/replay.py"], calls
    assert ("controller/replay.py", "pack") in calls
