"""The verdict on a rewritten graph's outputs next to the original's: one rule for ``optimize --check`` and for the
fp16 check ``compile`` runs on every fp16 component (:func:`.fp16_check.optimize_fp16_checked`).

An output passes when it is finite, its cosine with the original is at least :data:`MIN_COSINE`, and its largest
absolute difference is at most :data:`MAX_ABS_OF_SCALE` [precision] times its scale (the original's largest
magnitude). Where the original output itself holds inf/NaN (a Sqrt or Pow of the random normal inputs ``optimize``
makes), the rewritten one must hold the same inf/NaN at the same places and is compared on the rest: a faithful
rewrite of such a graph passes (it was refused as "does not match the original", its output removed).
fp16 that is silently wrong (a weight clipped to 65,504: cosine 0.02) fails on the cosine; a finite but drifting
output fails on the difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The least cosine (flattened outputs, float64) an output may have with the original's.
MIN_COSINE = 0.999
#: The largest |rewritten - original| an output may have, as a fraction of its scale (max |original|), per precision
#: of the rewritten graph: fp32 rewrites change the order of float operations only; fp16 rounds every tensor (11
#: bits: ~5e-4 relative per op) and accumulates through the graph.
MAX_ABS_OF_SCALE: dict[str, float] = {"fp32": 1e-3, "fp16": 5e-2}


@dataclass
class OutputParity:
    """One output compared: ``max_abs`` = max |rewritten - original|, ``cosine`` of the flattened arrays, ``scale`` =
    max |original|, all three where both are finite; ``finite`` = the rewritten output holds no inf/NaN but the
    original's own, at the same places; ``original_nonfinite`` = how many values of the original are inf/NaN."""

    name: str
    max_abs: float
    cosine: float
    scale: float
    finite: bool
    original_nonfinite: int = 0

    def to_json(self) -> dict[str, Any]:
        return {k: (float(v) if isinstance(v, float | np.floating) else v) for k, v in dataclasses.asdict(self).items()}

    def failure(self, precision: str) -> str | None:
        """Why this output fails the verdict for a graph of ``precision`` ("fp32" / "fp16"), or ``None``."""
        allowed = MAX_ABS_OF_SCALE.get(precision, MAX_ABS_OF_SCALE["fp16"])
        if not self.finite:
            where = " other than the original's" if self.original_nonfinite else ""
            return f"output {self.name!r} holds inf/NaN{where}"
        if self.cosine < MIN_COSINE or self.max_abs > allowed * self.scale:
            return (f"output {self.name!r}: cosine {self.cosine:.6f} (needs >= {MIN_COSINE}), max abs difference "
                    f"{self.max_abs:.3g} = {self.max_abs / self.scale if self.scale else float('inf'):.2g} x its scale "
                    f"{self.scale:.3g} (allowed {allowed:g} x)")
        return None


def output_parity(name: str, original: np.ndarray, rewritten: np.ndarray) -> OutputParity:
    """Compare one output of the original graph with the rewritten graph's (both read as float64); where the original
    holds inf/NaN, the rewritten must hold the same values there, and the figures are taken on the rest."""
    x, y = np.asarray(original, np.float64).ravel(), np.asarray(rewritten, np.float64).ravel()
    if x.shape != y.shape:
        return OutputParity(name, float("inf"), 0.0, 0.0, False)
    bad = ~np.isfinite(x)
    finite = bool(np.all(np.isfinite(y[~bad])) and np.array_equal(x[bad], y[bad], equal_nan=True))
    if bad.any() and finite:
        x, y = x[~bad], y[~bad]
    diff = float(np.max(np.abs(x - y))) if x.size else 0.0
    norm = float(np.linalg.norm(x) * np.linalg.norm(y))
    cosine = float(np.dot(x, y) / norm) if norm > 0 else float(np.array_equal(x, y))
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    return OutputParity(name, diff, cosine, scale, finite, int(bad.sum()))


def worst_parity(pairs: Iterable[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]]) -> list[OutputParity]:
    """Per output name, the worst comparison (a non-finite one, else the largest ``max_abs``) over several runs of
    ``(original outputs, rewritten outputs)``; outputs the rewritten graph lacks are skipped."""
    worst: dict[str, OutputParity] = {}
    for ref, new in pairs:
        for name, value in ref.items():
            if name not in new:
                continue
            item = output_parity(name, value, new[name])
            old = worst.get(name)
            if old is None or (not item.finite, item.max_abs) > (not old.finite, old.max_abs):
                worst[name] = item
    return list(worst.values())


def failures(outputs: Iterable[OutputParity], precision: str) -> list[str]:
    """The verdict: one line per failing output (empty: the rewritten graph passes)."""
    return [why for o in outputs if (why := o.failure(precision)) is not None]
