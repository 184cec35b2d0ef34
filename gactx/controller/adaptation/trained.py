"""What the training pass's record of an allocated save tells an estimate's probe passes (``gact_estimator.py``): the
noise its storage adds (:func:`noise`), the form a probe can store it in when nothing else is probed
(:func:`stored_form`) and, for a save whose op's backward is linear in it, that form's variance (:func:`context`)."""

from __future__ import annotations

import math

from gactx.controller.adaptation.choices import Choice
from gactx.controller.adaptation.widths import variance_factor
from gactx.controller.stats import AS_IS, KeyRecord

__all__ = ["NORMAL_CONTEXT", "context", "noise", "stored_form"]

# A tensor stored under the normal scheme has a known noise, priced as the allocator prices it (stored_form): a linear
# one is probed in one pass against the base like one stored as uniform codes; False: by a pair.
NORMAL_CONTEXT = True


def noise(record: KeyRecord) -> float:
    """What an allocated save's storage adds, in units of ``S`` (``sensitivity.py``'s ``noise_of``): ``S`` at its
    width, 0 where it is stored as it is."""
    return 0.0 if record.reason or record.bits > 8 else variance_factor(record.bits)


def context(record: KeyRecord, stored: tuple | None) -> float | None:
    """The variance of what a save stores when nothing is probed, in units of ``S(b)`` (``sensitivity.py``'s
    ``context_of``), for a save whose op's backward is linear in it (class ``linear``): 0 where it is stored as it is,
    else the noise of the form it is ``stored`` in (:func:`stored_form`: uniform codes, the normal scheme's, whose noise
    spreads over the rows alike). ``None`` for anything else: another scheme (a sketch, per-sample widths: rows stored
    unlike), bfloat16 rounding at 16 bits, and a backward that is not linear in the save (attention's probabilities),
    where the gradient's mean moves with the width, so that one pass against another width measures that move too,
    and a pair at one width does not."""
    if record.cls != "linear":
        return None
    if record.reason == AS_IS:
        return 0.0
    return None if stored is None else stored[2]


def stored_form(record: KeyRecord, choice: Choice | None, measured: dict, probe_bits: int) -> tuple | None:
    """How an allocated save is stored when nothing is probed, where a probe can store it so too, whatever its op's
    backward (``sensitivity.py``'s ``stored_of``: probed in that form against the base pass, a pair's second draw):
    ``(bits, None, S(b))`` for uniform codes; for the normal scheme's (``choice``, the plan's), ``(bits, choice, x)``
    with ``x = S(probe) V(choice) / V(uniform at the probe width)``, what the allocator prices it at, from the stored
    errors the meter ``measured`` in the same pass. ``None``: kept as it is, FewBit codes (class ``smooth``), a sketch
    or per-sample widths, bfloat16 rounding at 16 bits, no reference measured."""
    if record.cls == "smooth" or record.reason or record.bits is None or record.bits > 8:
        return None
    if not record.form:
        return record.bits, None, variance_factor(record.bits)
    if not NORMAL_CONTEXT or choice is None or choice.scheme != "normal":
        return None
    errors = measured.get(record.key.slot, {})
    reference, error = errors.get(Choice(probe_bits)), errors.get(choice)
    if not reference or error is None or not math.isfinite(error) or error <= 0:
        return None
    return record.bits, choice, variance_factor(probe_bits) * error / reference
