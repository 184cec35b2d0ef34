"""A Controller's checkpoint: what a resumed run needs to keep its allocation, as plain Python values
(``torch.save`` or JSON both take it), and the checks that refuse a state that is not one."""

from __future__ import annotations

import math

from gactx.controller.identity import Slot
from gactx.kernels import schemes
from gactx.kernels.schemes import Choice

__all__ = ["STATE_VERSION", "write_state", "read_state"]

STATE_VERSION = 1


def write_state(level: str, step: int, sensitivity: dict, bits: dict, choices: dict, schedule: list[int]) -> dict:
    """The state: the step, the sensitivities, bits and storage choices by slot (module name, call, index) as rows,
    the adaptation schedule (``[interval, next step]``, adaptation/schedule.py) and the level they belong to."""
    return {
        "version": STATE_VERSION,
        "level": level,
        "step": step,
        "sensitivity": [[*slot, c] for slot, c in sensitivity.items()],
        "bits": [[*slot, b] for slot, b in bits.items()],
        "choices": [[*slot, c.scheme, c.fraction, c.high] for slot, c in choices.items()],
        "schedule": list(schedule),
    }


def read_state(state: dict, level: str) -> tuple[int, dict, dict, dict, list[int] | None]:
    """``(step, sensitivity, bits, choices, schedule)`` of a :func:`write_state` state, or a ValueError naming what is
    wrong (``schedule`` None where the state has none: one written before it was kept). A state from another level is
    refused: its bits answer another budget."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(f"not a gactx Controller state (version {STATE_VERSION}): {type(state).__name__}")
    missing = [f for f in ("level", "step", "sensitivity", "bits") if f not in state]
    if missing:
        raise ValueError(f"gactx Controller state: missing {', '.join(map(repr, missing))}")
    if state["level"] != level:
        raise ValueError(f"state saved at level {state['level']!r} cannot load into level {level!r}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"gactx Controller state: 'step' must be an int >= 0, got {step!r}")
    sensitivity = _slots(state, "sensitivity", float)
    bits = _slots(state, "bits", int)
    schedule = state.get("schedule")
    if schedule is not None and not (
        isinstance(schedule, (list, tuple))
        and len(schedule) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in schedule)
    ):
        raise ValueError(
            f"gactx Controller state: 'schedule' must be [interval, next step], ints >= 1, got {schedule!r}"
        )
    return step, sensitivity, bits, _choices(state.get("choices", []), bits), schedule


def _slots(state: dict, field: str, kind: type) -> dict:
    """``state[field]``: rows ``[module, call, index, value]`` as ``{(module, call, index): value}``, or a
    ValueError naming the field and the first bad row."""
    rows = state[field]
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"gactx Controller state: {field!r} must be a list of [module, call, index, value] rows")
    out = {}
    for row in rows:
        ok = isinstance(row, (list, tuple)) and len(row) == 4 and isinstance(row[0], str)
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in row[1:3])
        ok = ok and isinstance(row[3], (int, float)) and not isinstance(row[3], bool)
        if ok and kind is int:
            ok = isinstance(row[3], int) or float(row[3]).is_integer()
        if not ok or not math.isfinite(row[3]):
            raise ValueError(f"gactx Controller state: {field!r} has a malformed row {row!r}")
        out[Slot(row[0], row[1], row[2])] = kind(row[3])
    return out


def _choices(rows, bits: dict) -> dict:
    """``state["choices"]``: rows ``[module, call, index, scheme, fraction, high]`` (a slot of ``bits``) as Choices,
    or a ValueError naming the first bad row."""
    if not isinstance(rows, (list, tuple)):
        raise ValueError(
            "gactx Controller state: 'choices' must be a list of [module, call, index, scheme, fraction, high] rows"
        )
    out = {}
    for row in rows:
        ok = isinstance(row, (list, tuple)) and len(row) == 6 and tuple(row[:3]) in bits
        ok = ok and row[3] in schemes.names() and isinstance(row[4], (int, float)) and not isinstance(row[4], bool)
        ok = ok and isinstance(row[5], int) and not isinstance(row[5], bool) and 0 < row[4] <= 1
        if not ok:
            raise ValueError(f"gactx Controller state: 'choices' has a malformed row {row!r}")
        slot = Slot(*row[:3])
        out[slot] = Choice(bits[slot], row[3], float(row[4]), row[5])
    return out
