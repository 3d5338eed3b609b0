"""The errors of one result tensor over several comparisons, mergeable across ranks (the numerics check)."""

from __future__ import annotations

import numpy as np

from meshplan.plan.json.measurement import TensorError


class Tally:
    """The errors of one tensor over several comparisons: max and mean |error|, max |reference|, and the
    one-process error (where a comparison has a one-process result). Equal infinities (LSE = −inf on a row
    with no permitted key) are no error; a NaN is an infinite one."""

    def __init__(self) -> None:
        self.worst, self.total, self.count, self.ref_max, self.single = 0.0, 0.0, 0, 0.0, 0.0

    def add(self, got: np.ndarray, ref: np.ndarray, single: np.ndarray | None) -> None:
        err = abs_err(got, ref)
        self.worst = max(self.worst, float(err.max(initial=0.0)))
        self.total += float(err[np.isfinite(err)].sum()) if err.size else 0.0
        self.count += err.size
        finite = ref[np.isfinite(ref)]
        self.ref_max = max(self.ref_max, float(np.abs(finite).max(initial=0.0)))
        if single is not None:
            self.single = max(self.single, float(abs_err(single, ref).max(initial=0.0)))

    def add_constant(self, got: np.ndarray, value: float) -> None:
        """Values that must equal ``value`` exactly (0, or −inf), compared in place (no float64 copy)."""
        if not got.size:
            return
        if np.isinf(value):
            worst = 0.0 if bool((got == value).all()) else float("inf")
            self.worst = max(self.worst, worst)
        else:
            dev = np.abs(got)
            worst = float(dev.max())
            self.worst = max(self.worst, worst if np.isfinite(worst) else float("inf"))
            self.total += float(dev[np.isfinite(dev)].sum(dtype=np.float64))
        self.count += got.size

    def merge(self, other: Tally) -> None:
        """Fold another rank's tally of the same tensor into this one."""
        self.worst, self.ref_max = max(self.worst, other.worst), max(self.ref_max, other.ref_max)
        self.single = max(self.single, other.single)
        self.total, self.count = self.total + other.total, self.count + other.count

    def error(self, eps: float) -> TensorError:
        floor = eps * self.ref_max
        bound = max(floor, 3 * self.single)
        return TensorError(max_abs_err=self.worst, mean_abs_err=self.total / max(self.count, 1),
                           single_process_err=self.single, floor=floor, bound=bound, passed=self.worst <= bound)


def abs_err(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got − ref| in float64; 0 where both are the same infinity, ∞ where either is NaN or one is infinite."""
    g = np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        err = np.abs(g - ref)
    err[g == ref] = 0.0
    err[np.isnan(err)] = np.inf
    return err
