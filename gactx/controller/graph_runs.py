"""Which saves of compiled graphs ran: read while the graphs run, recorded into the pack path's passes.

A compiled graph tells of its saves in one of two ways (``compiled.py`` decides which when it traces them). The C++ ops
of CPU tensors log a save as they run it (its token and shape) and the release of what they return, and the log is
read here in order (:meth:`GraphRuns.drain`) before the controller reads its passes, at module calls and eager saves,
and once a step. The Python ops of every other device call :meth:`GraphRuns.ran` as they run. A graph's saves of static
shapes are recorded with its first one (``CompiledPath._follows``): one log entry a graph run, whose followers' records
are made and summed once for runs like it, and added in one call.

A whole compiled model's pass begins when the graphs of the last one are gone (every save they logged released, and
what the Python ops returned freed) or when a region runs again; under an eager model, as eager passes begin.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from gactx.controller.identity import ModuleTracker
from gactx.controller.stats import CompiledRun
from gactx.kernels import cpu

__all__ = ["RECORDS_KEPT", "GraphRuns"]

RECORDS_KEPT = 64  # records kept for runs like an earlier one (a save's, a lead's followers'): the newest


@dataclass
class _Run:
    call: int
    seen: set = field(default_factory=set)


class GraphRuns:
    """The runs of compiled graphs' saves (the module docstring). ``saves``: token -> ``compiled.GraphSave``;
    ``followers``: a lead's token -> ``(token, shape)`` of the saves recorded with it (both ``CompiledPath``'s, filled
    as it traces); ``path``: the eager pack path, whose statistics and pass boundaries compiled saves share."""

    def __init__(self, saves: dict, followers: dict, tracker: ModuleTracker, path) -> None:
        self.saves, self.followers, self.tracker, self.path = saves, followers, tracker, path
        self.logging = False  # graphs call the C++ ops, which log their runs: read by drain()
        self._alive: list[weakref.ref] = []  # the counts that the graphs of the pass under way hold
        self._held: dict[int, int] = {}  # token -> its logged saves that graphs still hold
        self._tokens: set[int] = set()  # the logged saves' tokens of the pass under way
        self._holding = 0  # how many of them graphs still hold a save of (_held above 0): kept as events come
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # a lead's token -> its followers' tokens
        self._made: dict[tuple, CompiledRun] = {}  # (lead, frame, call) -> its followers' records (_followed)

    def followed_anew(self, lead: int) -> None:
        """The lead's followers changed (a graph traced): records made for the old ones are dropped."""
        self._tokens_of[lead] = tuple(f for f, _ in self.followers[lead])
        self._made.clear()

    def ran(self, token: int, t: torch.Tensor, count: torch.Tensor) -> None:
        """A compiled graph ran the save of ``token`` (``t`` the tensor, ``count`` what the graph saves with
        it), through a Python op: record it in the pass under way."""
        self.drain()  # the C++ ops' saves before it, if any
        self._record(token, tuple(t.shape), weakref.ref(count))

    def drain(self) -> None:
        """Record the saves the C++ ops logged since the last call, in order, and the releases of what they returned
        (what tells that a pass's graphs are gone, see :meth:`_record`). Called before the controller reads its
        passes, at module calls and eager saves (so that records keep the order and the module of their saves), and
        once a step; nothing to do until a graph calls the ops."""
        if not self.logging:
            return
        log, i = cpu.drain_log(), 0
        held, tokens = self._held, self._tokens
        while i < len(log):
            kind, token, rank = log[i], log[i + 1], log[i + 2]
            if kind == 2:
                before = held.get(token, 1)
                after = held[token] = before - 1
            else:
                self._record(token, tuple(log[i + 3 : i + 3 + rank]), None)
                tokens = self._tokens  # a new pass replaces the set
                before = held.get(token, 0)
                after = held[token] = before + 1
            if (before > 0) != (after > 0) and token in tokens:
                self._holding += 1 if after > 0 else -1
            i += 3 + rank

    def _record(self, token: int, shape: tuple[int, ...], alive: weakref.ref | None) -> None:
        """Record a run of the save of ``token``. Under an eager model (compiled blocks) the model's forward pre-hook
        begins passes, and a region run again is its next call. With no eager module of the model running (the
        whole model compiled), a save begins a new pass when the graphs of the pass under way are gone (their
        backward has run, or they were dropped: what the graphs hold, ``alive`` or a logged save's marker, is
        freed) or when its region runs a second time."""
        save = self.saves.get(token)
        if save is None:
            return
        path = self.path
        stats = path.begin_pass_if_fresh()
        run = stats.graph_runs.get(save.graph)
        if not self.tracker.inside and (stats.graph_runs or stats.records):
            rerun = run is not None and token in run.seen
            if rerun or not stats.graph_runs or self._gone():
                path.fresh = True
                stats, run = path.begin_pass_if_fresh(), None
        if not stats.graph_runs:
            self._alive, self._tokens, self._holding = [], set(), 0
        if alive is None:
            if token not in self._tokens:
                self._tokens.add(token)
                self._holding += 1 if self._held.get(token, 0) > 0 else 0
        else:
            self._alive.append(alive)
        if run is None or token in run.seen:
            run = stats.graph_runs[save.graph] = _Run(1 if run is None else run.call + 1)
        run.seen.add(token)
        frame = self.tracker.frame()
        stats.add_compiled(save.record(frame, run.call, shape), save.compressed)
        followers = self.followers.get(token)
        if followers:
            run.seen.update(self._tokens_of[token])
            stats.add_compiled_run(self._followed(token, frame, run.call))

    def _followed(self, lead: int, frame: tuple[str, int] | None, call: int) -> CompiledRun:
        """The records of a run of the lead's followers under ``frame`` and ``call``, summed: made once for runs like
        an earlier one."""
        made = self._made.get((lead, frame, call))
        if made is None:
            saves = [(self.saves[f], static) for f, static in self.followers[lead]]
            made = CompiledRun.of([(save.record(frame, call, static), save.compressed) for save, static in saves])
            if len(self._made) >= RECORDS_KEPT:
                self._made.clear()
            self._made[(lead, frame, call)] = made
        return made

    def _gone(self) -> bool:
        """Whether the graphs of the pass under way hold none of its saves any more (their backward ran, or they were
        dropped): no count a Python op's save returned is alive, and no logged save is unreleased."""
        return self._holding == 0 and not any(ref() is not None for ref in self._alive)
