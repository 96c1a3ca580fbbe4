"""RoPE frequency types: a registry from the config's `rope_type` to (inv_freq, attention scaling), computed as
transformers' `modeling_rope_utils` computes them (float32, the same formulas), for a static sequence length.

A type is a function `(spec, params, seq_length) -> (inv_freq [R/2] float32, attention_scaling)` registered
with `@rope_type(name)`; `params` is the spec's `rope_scaling` dict. An unknown type is refused by name.
Types whose frequencies transformers recomputes at run time from the current length are resolved for the
stages' `seq_length`, which is fixed when a bundle is built (see each type).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from topq.ir.errors import TopqError

__all__ = ["ROPE_TYPES", "RopeSpec", "rope_inv_freq", "rope_type"]


class RopeSpec(Protocol):
    """What the frequency schedule reads of a model's configuration (`topq.core.spec.RopeSpec` has it)."""

    @property
    def architecture(self) -> str: ...
    @property
    def rope_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...
    @property
    def max_position_embeddings(self) -> int: ...


RopeFn = Callable[[RopeSpec, Mapping[str, Any], int], tuple[np.ndarray, float]]
ROPE_TYPES: dict[str, RopeFn] = {}
F32 = np.float32


def rope_type(name: str) -> Callable[[RopeFn], RopeFn]:
    def register(fn: RopeFn) -> RopeFn:
        ROPE_TYPES[name] = fn
        return fn
    return register


def rope_inv_freq(spec: RopeSpec, seq_length: int | None = None, theta: float | None = None,
                  scaling: Mapping[str, Any] | None = None) -> tuple[np.ndarray, float]:
    """inv_freq and attention scaling of the spec's RoPE (or of `theta`/`scaling` when given: a per-layer RoPE)
    for sequences of up to `seq_length` positions (default: max_position_embeddings)."""
    params = dict(spec.rope_scaling or {}) if scaling is None else dict(scaling)
    params.setdefault("rope_theta", spec.rope_theta if theta is None else theta)
    kind = params.get("rope_type", "default")
    fn = ROPE_TYPES.get(kind)
    if fn is None:
        raise TopqError(f"{spec.architecture}: rope type {kind!r} is not supported ({', '.join(sorted(ROPE_TYPES))})")
    try:
        inv_freq, attention_scaling = fn(spec, params, seq_length or spec.max_position_embeddings)
    except KeyError as e:
        raise TopqError(f"{spec.architecture}: rope type {kind!r} needs {e.args[0]!r} in rope_scaling") from None
    return inv_freq.astype(F32), float(attention_scaling)


def _exponents(spec: RopeSpec) -> np.ndarray:
    dim = spec.rope_dim
    return np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)


def _base_freq(spec: RopeSpec, base: float) -> np.ndarray:
    return (F32(1.0) / (F32(base) ** _exponents(spec))).astype(F32)


@rope_type("default")
def _default(spec: RopeSpec, p: Mapping[str, Any], seq_length: int) -> tuple[np.ndarray, float]:
    return _base_freq(spec, p["rope_theta"]), 1.0


@rope_type("linear")
def _linear(spec: RopeSpec, p: Mapping[str, Any], seq_length: int) -> tuple[np.ndarray, float]:
    return _base_freq(spec, p["rope_theta"]) / F32(p["factor"]), 1.0


@rope_type("llama3")
def _llama3(spec: RopeSpec, p: Mapping[str, Any], seq_length: int) -> tuple[np.ndarray, float]:
    inv_freq = _base_freq(spec, p["rope_theta"])
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled), 1.0


@rope_type("dynamic")
def _dynamic(spec: RopeSpec, p: Mapping[str, Any], seq_length: int) -> tuple[np.ndarray, float]:
    """Dynamic NTK: transformers rescales the base from the current length once it exceeds
    max_position_embeddings, and uses the plain frequencies below it. A static bundle cannot follow a base that
    changes with each call, so it is built only where transformers' frequencies are the plain ones."""
    limit = spec.max_position_embeddings
    if seq_length > limit:
        raise TopqError(f"{spec.architecture}: dynamic rope scaling changes its frequencies with the run-time "
                        f"length beyond max_position_embeddings={limit}; stages.seq_length={seq_length} must not "
                        "exceed it")
    factor = float(p["factor"])
    dim = spec.rope_dim
    base = p["rope_theta"] * ((factor * limit / limit) - (factor - 1)) ** (dim / (dim - 2))
    return _base_freq(spec, base), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@rope_type("yarn")
def _yarn(spec: RopeSpec, p: Mapping[str, Any], seq_length: int) -> tuple[np.ndarray, float]:
    base, dim = p["rope_theta"], spec.rope_dim
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or spec.max_position_embeddings / original
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    pos_freqs = F32(base) ** _exponents(spec)
    extrapolation = F32(1.0) / pos_freqs
    interpolation = F32(1.0) / (F32(factor) * pos_freqs)
    keep = F32(1.0) - ramp  # the share of the unscaled (extrapolated) frequency
    return interpolation * (F32(1.0) - keep) + extrapolation * keep, float(attention)


@rope_type("longrope")
def _longrope(spec: RopeSpec, p: Mapping[str, Any], seq_length: int) -> tuple[np.ndarray, float]:
    """LongRoPE / su (Phi-3): per-frequency factors, `short_factor` up to original_max_position_embeddings and
    `long_factor` beyond it. transformers picks the set from each forward pass's length; a bundle picks it from
    seq_length, so a bundle with seq_length ≤ the original length equals transformers everywhere."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or spec.max_position_embeddings / original
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(p["long_factor"] if seq_length > original else p["short_factor"], dtype=F32)
    if ext.shape != (spec.rope_dim // 2,):
        raise TopqError(f"{spec.architecture}: longrope factors have {ext.size} entries, expected "
                        f"{spec.rope_dim // 2}")
    return F32(1.0) / (ext * F32(p["rope_theta"]) ** _exponents(spec)), float(attention)


# The spelling older configs use for LongRoPE.
ROPE_TYPES["su"] = _longrope
