"""A normalisation input's curve: its gradient variance at each width, fitted through two (``sensitivity.py``).

GACT's model, ``C S(b)``, holds where backward is linear in the saved tensor. The input of a normalisation is read
twice over (``rules.curved``): its gradient variance is ``C_lin S(b) + Q S(b)**2``. It is probed at
:data:`CURVE_WIDTHS`, each width by a pair of passes, or by one pass against the base pass where its stored form's noise
is no larger than the width's (:data:`CURVE_BASE`: then the point is the curve at both, ``v(b) + v(stored)``), and
:func:`fit_curve` solves for ``C_lin`` and ``Q``.
"""

from __future__ import annotations

import math

from gactx.controller.adaptation.widths import variance_factor

__all__ = ["CURVE_BASE", "CURVE_WIDTHS", "fit_curve", "partner"]

# The widths a curved tensor is probed at: the narrowest, where the quadratic part shows, and one where it has faded.
# Every width the allocator may give lies between them or past 4 bits, where the fit is the 4-bit point's line:
# nothing is extrapolated towards narrower widths.
CURVE_WIDTHS = (1, 4)
# A normalisation input's curve width narrower than the form it is stored in (its noise at least the stored form's) is
# measured in one pass against the base, not a pair: ``D = v(w) + v(stored)``, both on the curve (fit_curve's
# ``partners``); False: a pair.
CURVE_BASE = True


def partner(form: tuple | None, bits: int) -> float | None:
    """The noise (in units of ``S``) of the base's draw of a curved slot stored as ``form`` (``stored_of``'s) that a
    pass probing it at ``bits`` is measured against (:data:`CURVE_BASE`), or ``None``: a pair, or the same width (the
    base's draw is the pair's other one)."""
    if not CURVE_BASE or form is None or (form[1] is None and form[0] == bits):
        return None
    return form[2] if form[2] <= variance_factor(bits) else None


def fit_curve(
    variance: dict[int, float], probe_bits: int, partners: dict[int, float] | None = None
) -> tuple[tuple[float, float], float]:
    """Fit ``v(b) = C_lin S(b) + Q S(b)**2`` through the gradient variances measured at two widths, ``C_lin`` and
    ``Q`` at least 0 (where the two points say otherwise, the noise of one pair each, the larger of the two that
    either point alone gives: the allocator then overrates the tensor, never underrates it). Returns ``((a, q),
    C)``: the sensitivity ``C = v(probe_bits) / S(probe_bits)`` and the shape of the curve per unit of it,
    ``v = C (a x + q x**2)`` at ``x = S(b)``. A variance that is not finite is returned as ``C`` (``cap`` ends it).
    ``partners``: by width, the noise ``x_p`` of the base's draw a point was measured against (:data:`CURVE_BASE`);
    that point's value is ``v(b) + v(x_p)``, the curve at both."""
    (wide, v_wide), (narrow, v_narrow) = sorted(variance.items(), reverse=True)
    x_wide, x_narrow = variance_factor(wide), variance_factor(narrow)
    if not (math.isfinite(v_wide) and math.isfinite(v_narrow)):
        return (1.0, 0.0), math.inf
    if partners:  # each point a line in (C_lin, Q): value = C_lin (x + x_p) + Q (x**2 + x_p**2)
        points = [(x + partners.get(b, 0.0), x * x + partners.get(b, 0.0) ** 2, v)
                  for b, x, v in ((wide, x_wide, v_wide), (narrow, x_narrow, v_narrow))]  # fmt: skip
        (a1, b1, v1), (a2, b2, v2) = points
        det = a1 * b2 - a2 * b1
        lin, q = (v1 * b2 - v2 * b1) / det, (a1 * v2 - a2 * v1) / det
        if q < 0:
            lin, q = max(v1 / a1, v2 / a2), 0.0
        elif lin < 0:
            lin, q = 0.0, max(v1 / b1, v2 / b2)
    else:
        r_wide, r_narrow = v_wide / x_wide, v_narrow / x_narrow
        q = (r_narrow - r_wide) / (x_narrow - x_wide)
        lin = r_wide - q * x_wide
        if q < 0:
            lin, q = max(r_wide, r_narrow), 0.0
        elif lin < 0:
            lin, q = 0.0, max(v_wide / x_wide**2, v_narrow / x_narrow**2)
    x = variance_factor(probe_bits)
    c = lin + q * x
    if c <= 0:
        return (1.0, 0.0), 0.0
    return (lin / c, q / c), c
