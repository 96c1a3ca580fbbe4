"""Decoding settings and the choice of the next token from logits (greedy, temperature, top-k, top-p,
repetition penalty), and the likelihood of the tokens that did come (`token_nll` for perplexity, `head_nll` from the
final hidden states). Plain numpy; the runtime (`topq.core.runtime`) uses it, and re-exports `Sampling` for its
callers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from topq.ir.errors import TopqError


@dataclass
class Sampling:
    """Decoding settings. temperature 0 (or greedy=True) is greedy decoding."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise TopqError("sampling: need temperature ≥ 0, 0 < top_p ≤ 1, top_k ≥ 0, repetition_penalty > 0")
        self._rng = np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        logits = np.asarray(logits, dtype=np.float64).copy()
        if self.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history))
            # The CTRL / transformers rule: shrink positive logits, grow negative ones.
            vals = logits[seen]
            logits[seen] = np.where(vals > 0, vals / self.repetition_penalty, vals * self.repetition_penalty)
        if self.greedy or self.temperature == 0:
            return int(np.argmax(logits))
        logits /= self.temperature
        if self.top_k and self.top_k < logits.size:
            kth = np.partition(logits, -self.top_k)[-self.top_k]
            logits[logits < kth] = -np.inf
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = cumulative - probs[order] < self.top_p  # always keeps the most likely token
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self._rng.choice(probs.size, p=probs))


def token_nll(logits: np.ndarray, targets: np.ndarray, overwrite: bool = False) -> float:
    """−Σ_t log softmax(logits[t])[targets[t]] for logits [T, V] (any float dtype; float32 is not copied).

    The exponentials are float32, the row sums and the total float64: over a 49k-entry vocabulary that is half the
    memory traffic of an all-float64 softmax, with a vectorized exp; the error against float64 is ~1e-7 nats per
    token (tested), far below any perplexity digit reported. `overwrite`: float32 logits the caller no longer
    needs are the work buffer (no second [T, V] array; the same values)."""
    return float(_row_nll(np.asarray(logits, dtype=np.float32), targets, overwrite).sum())


#: positions per product in `head_nll`: 128 × a 49k vocabulary is 24 MiB of logits, against 96 MiB for 512 at once.
#: Fewer rows cost time: every product packs the whole head again (SmolLM2's window: 64 rows 1.41×, 128 1.17×,
#: 256 1.06× one product's time, docs/speed.md).
HEAD_ROWS = 128


def head_nll(hidden: np.ndarray, head: np.ndarray, targets: np.ndarray, rows: int = HEAD_ROWS) -> float:
    """`token_nll(hidden @ head.T, targets)` for hidden [T, H] and a head [V, H], without the [T, V] logits: `rows`
    positions at a time into one reused buffer. Each position's value is computed as there (a row of a product does
    not depend on the other rows' count with the BLAS kernels measured, docs/speed.md) and the total is the same
    float64 sum of them."""
    hidden, head = np.asarray(hidden, np.float32), np.asarray(head, np.float32)
    targets = np.asarray(targets)
    per_position = np.empty(len(targets), np.float64)
    buffer = np.empty((min(rows, len(targets)), head.shape[0]), np.float32)
    for start in range(0, len(targets), rows):
        end = min(start + rows, len(targets))
        logits = np.matmul(hidden[start:end], head.T, out=buffer[: end - start])
        per_position[start:end] = _row_nll(logits, targets[start:end], overwrite=True)
    return float(per_position.sum())


def _row_nll(logits: np.ndarray, targets: np.ndarray, overwrite: bool) -> np.ndarray:
    """Each position's −log softmax(logits[t])[targets[t]] (float64), as `token_nll` sums them."""
    top = logits.max(axis=-1, keepdims=True)
    shifted = np.subtract(logits, top, out=logits if overwrite and logits.flags.writeable else None)
    picked = shifted[np.arange(len(targets)), np.asarray(targets)].astype(np.float64)
    np.exp(shifted, out=shifted)
    log_sums = np.log(shifted.sum(axis=-1, dtype=np.float64))
    return log_sums - picked
