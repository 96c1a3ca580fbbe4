"""Activation range observers for static int8 calibration: minmax, percentile and KL divergence (TensorRT).

An observer sees batches of one tensor and returns the symmetric clipping threshold T (the int8 scale is T/127):

* `minmax`: T = max |x| (exact; nothing is clipped);
* `percentile`: T = the p-th percentile of |x|, read from a 2048-bin histogram of |x| (linear interpolation inside
  the bin: within one bin width of np.percentile);
* `kl`: TensorRT's entropy calibration on the same histogram: for every candidate edge i in [128, 2048] the
  clipped reference distribution P (the outliers added to the last kept bin) is compared with its 128-level
  quantized version Q, and T is the edge with the smallest KL(P || Q).

The histogram covers [0, R]; when a batch exceeds R the range doubles and pairs of bins merge, so counts stay
exact and one pass over the data suffices (giving R up front — e.g. from a minmax pass — avoids the merging).
"""

from __future__ import annotations

import math

import numpy as np

from topq.core.errors import TopqError

OBSERVERS = ("minmax", "percentile", "kl")
BINS = 2048
QUANT_LEVELS = 128  # int8 symmetric: 128 non-negative magnitude levels


class Observer:
    """Running |x| statistics of one tensor: absmax, per-channel absmax and (if asked) a histogram."""

    def __init__(self, kind: str = "minmax", percentile: float = 99.99, bins: int = BINS,
                 range_max: float | None = None) -> None:
        if kind not in OBSERVERS:
            raise TopqError(f"unknown observer {kind!r}; known: {', '.join(OBSERVERS)}")
        if not 0 < percentile <= 100:
            raise TopqError(f"percentile must be in (0, 100], got {percentile}")
        self.kind = kind
        self.percentile = float(percentile)
        self.bins = int(bins)
        self.absmax = 0.0
        self.channel_absmax: np.ndarray | None = None
        self.count = 0
        self.hist = np.zeros(self.bins, dtype=np.int64) if kind != "minmax" else None
        self.range = float(range_max) if range_max else 0.0

    def add(self, x: np.ndarray) -> None:
        a = np.abs(np.asarray(x, dtype=np.float32))
        a2 = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
        if not np.isfinite(a2).all():
            raise TopqError("observer: activations contain inf or NaN")
        ch = a2.max(axis=0)
        self.channel_absmax = ch if self.channel_absmax is None else np.maximum(self.channel_absmax, ch)
        batch_max = float(ch.max()) if ch.size else 0.0
        self.absmax = max(self.absmax, batch_max)
        self.count += a2.size
        if self.hist is not None:
            self._add_hist(a2.reshape(-1), batch_max)

    def _add_hist(self, a: np.ndarray, batch_max: float) -> None:
        assert self.hist is not None
        if self.range <= 0:
            self.range = batch_max if batch_max > 0 else 1.0
        while batch_max > self.range:  # double the range: bin i of the new histogram = bins 2i, 2i+1 of the old
            merged = self.hist.reshape(-1, 2).sum(axis=1)
            self.hist = np.concatenate([merged, np.zeros(self.bins - merged.size, np.int64)])
            self.range *= 2
        idx = np.minimum((a * (self.bins / self.range)).astype(np.int64), self.bins - 1)
        self.hist += np.bincount(idx, minlength=self.bins)

    def merge(self, other: Observer) -> None:
        """Add the statistics of `other`, an observer of other batches of the same tensor (a worker's share of the
        calibration data). Maxima and integer counts: the result does not depend on how the batches were split or
        in which order partial observers merge — provided their histograms cover the same range (give `range_max`
        up front); ranges a power of two apart are aligned by merging bins, as `add` does when it grows."""
        if other.kind != self.kind or other.bins != self.bins:
            raise TopqError(f"cannot merge a {other.kind} observer ({other.bins} bins) into a {self.kind} one "
                            f"({self.bins} bins)")
        if other.count == 0:
            return
        if other.channel_absmax is not None:
            if self.channel_absmax is None:
                self.channel_absmax = other.channel_absmax.copy()
            elif self.channel_absmax.shape != other.channel_absmax.shape:
                raise TopqError(f"cannot merge observers of {other.channel_absmax.size} and "
                                f"{self.channel_absmax.size} channels")
            else:
                self.channel_absmax = np.maximum(self.channel_absmax, other.channel_absmax)
        self.absmax = max(self.absmax, other.absmax)
        if self.hist is not None and other.hist is not None:
            if self.count == 0 and not self.hist.any():
                self.range = other.range if self.range <= 0 else self.range
            theirs = other.hist
            if self.range != other.range:
                low, high = sorted((self.range, other.range))
                steps = math.log2(high / low) if low > 0 else 0.5
                if steps != int(steps):
                    raise TopqError(f"cannot merge histograms over [0, {self.range}] and [0, {other.range}]")
                while self.range < other.range:
                    self._double_range()
                r = other.range
                while r < self.range:
                    merged = theirs.reshape(-1, 2).sum(axis=1)
                    theirs = np.concatenate([merged, np.zeros(self.bins - merged.size, np.int64)])
                    r *= 2
            self.hist = self.hist + theirs
        self.count += other.count

    def _double_range(self) -> None:
        """Bin i of the histogram over twice the range = bins 2i, 2i+1 of this one."""
        assert self.hist is not None
        merged = self.hist.reshape(-1, 2).sum(axis=1)
        self.hist = np.concatenate([merged, np.zeros(self.bins - merged.size, np.int64)])
        self.range *= 2

    @property
    def bin_width(self) -> float:
        return self.range / self.bins

    def threshold(self) -> float:
        """The clipping threshold T (> 0) for this observer's kind."""
        if self.count == 0:
            raise TopqError("observer saw no data")
        if self.absmax == 0:
            return 1.0  # an all-zero tensor: any scale gives code 0
        if self.kind == "minmax":
            return self.absmax
        assert self.hist is not None
        if self.kind == "percentile":
            return min(percentile_from_hist(self.hist, self.range, self.percentile), self.absmax)
        return min(kl_threshold(self.hist, self.range), self.absmax)


def percentile_from_hist(hist: np.ndarray, range_max: float, p: float) -> float:
    """The p-th percentile of the values a histogram over [0, range_max] counts (linear inside the bin)."""
    cdf = np.cumsum(hist)
    total = cdf[-1]
    target = total * p / 100.0
    i = int(np.searchsorted(cdf, target, side="left"))
    i = min(i, hist.size - 1)
    before = cdf[i - 1] if i else 0
    frac = (target - before) / hist[i] if hist[i] else 1.0
    width = range_max / hist.size
    return float((i + min(max(frac, 0.0), 1.0)) * width)


def kl_threshold(hist: np.ndarray, range_max: float, levels: int = QUANT_LEVELS) -> float:
    """TensorRT's entropy calibration: the bin edge i·width (i ≥ levels) minimising KL(P_i || Q_i)."""
    hist = np.asarray(hist, dtype=np.float64)
    n = hist.size
    if n <= levels:
        return float(range_max)
    width = range_max / n
    best_i, best_kl = n, np.inf
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # suffix[i] = sum(hist[i:])
    for i in range(levels, n + 1):
        p = hist[:i].copy()
        p[-1] += suffix[i]  # the clipped outliers land in the last kept bin
        if p.sum() == 0:
            continue
        nonzero = hist[:i] != 0
        # merge the i reference bins into `levels` quantized bins, then spread each back over its non-empty bins
        edges = (np.arange(levels + 1) * i) // levels  # i >= levels: every chunk has at least one bin
        sums = np.add.reduceat(hist[:i], edges[:-1])
        counts = np.add.reduceat(nonzero.astype(np.float64), edges[:-1])
        per_bin = np.divide(sums, counts, out=np.zeros(levels), where=counts > 0)
        q = np.repeat(per_bin, np.diff(edges)) * nonzero
        kl = _kl(p, q)
        if kl < best_kl:
            best_kl, best_i = kl, i
    return float(best_i * width)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(P || Q) of two unnormalised histograms; a bin with P > 0 and Q = 0 costs as TensorRT (smoothed)."""
    p = p / p.sum()
    qs = q.sum()
    if qs == 0:
        return np.inf
    q = q / qs
    mask = p > 0
    qm = np.where(q[mask] > 0, q[mask], 1e-10)  # only P's last bin can meet Q = 0 (the outliers); penalise it
    return float(np.sum(p[mask] * np.log(p[mask] / qm)))
