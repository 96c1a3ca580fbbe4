"""The runtime: orchestrates a bundle's static stage functions into prompts, decoding and chat.

Scenarios (DESIGN §2): prefill + decode; multi-turn chat reusing the KV cache (later turns run
`block_kv_*` or, without it, decode steps); prompts longer than max_input_length as one prefill plus
prefill-with-history segments; decode picks the smallest variant whose history length fits.
The KV cache lives here as one [1, S, KVH, D] array pair per layer; `length` is how much is valid,
so truncating the conversation is free. A recurrent layer (the bundle's `stages.layer_states`) carries its
states instead: each call hands them to the next, and since a state cannot be cut back, the session keeps the
states at the end of the last few `feed`s and truncation goes back to the latest one at or before the new
length and feeds the tokens after it again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.plugins import get_plugins
from topq.core.stages import stage_window
from topq.core.target import Executor
from topq.ir.sampling import Sampling, token_nll
from topq.ir.threads import blas_threads, threads_for

NEG_INF = np.float32(-np.inf)
#: recurrent models: how many feeds' states a session keeps for going back (the latest ones: a chat re-renders
#: the last turns); older truncation points are reached by feeding again from the start
SAVED_STATES = 4


def open_executor(bundle: Bundle) -> Executor:
    return get_plugins().targets.get(bundle.target).open(bundle)


class Session:
    """One conversation with a compiled model: a KV cache and the calls that fill it."""

    def __init__(self, bundle: Bundle, executor: Executor | None = None) -> None:
        self.bundle = bundle
        self.executor = executor if executor is not None else open_executor(bundle)
        attrs = bundle.meta["stages"]
        self.seq_length: int = attrs["seq_length"]
        self.max_input_length: int = attrs["max_input_length"]
        self.has_prefill_kv: bool = attrs["prefill_kv"]
        self.decode_variants: list[int] = sorted(attrs["decode_variants"])
        spec = bundle.spec
        self.spec = spec
        shape = (1, self.seq_length, spec.num_kv_heads, spec.head_dim)
        carries = attrs.get("layer_states") or [[] for _ in range(spec.num_layers)]
        #: per layer: the shapes of the states it carries; () for a KV layer
        self.state_shapes: list[tuple[tuple[int, ...], ...]] = [tuple(tuple(s) for _, s in c) for c in carries]
        kv_layers = [not shapes for shapes in self.state_shapes]
        self.k_cache: list[np.ndarray | None] = [np.zeros(shape, np.float32) if kv else None for kv in kv_layers]
        self.v_cache: list[np.ndarray | None] = [np.zeros(shape, np.float32) if kv else None for kv in kv_layers]
        self.states: list[list[np.ndarray]] = self._zero_states()
        self._saved: dict[int, list[list[np.ndarray]]] = {}  # length → the states after it (recurrent models)
        self.windows = [stage_window(spec, layer, self.seq_length) for layer in range(spec.num_layers)]
        self.tokens: list[int] = []  # what the KV cache holds
        self.calls: list[str] = []  # functions run, for tests and inspection

    @property
    def recurrent(self) -> bool:
        return any(self.state_shapes)

    def _zero_states(self) -> list[list[np.ndarray]]:
        return [[np.zeros(s, np.float32) for s in shapes] for shapes in self.state_shapes]

    @property
    def length(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.truncate(0)

    def truncate(self, length: int) -> None:
        if not self.recurrent or length >= self.length:
            self.tokens = self.tokens[:length]
            return
        # states cannot be cut back: restart from the last saved states at or before `length`
        kept = self.tokens[:length]
        start = max((n for n in self._saved if n <= length), default=0)
        self._saved = {n: states for n, states in self._saved.items() if n <= start}
        self.states = [[a.copy() for a in layer] for layer in self._saved[start]] if start else self._zero_states()
        self.tokens = kept[:start]
        if length > start:
            self.feed(kept[start:])

    def _run(self, name: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        self.calls.append(name)
        return self.executor.run(name, inputs)

    # -- feeding tokens ----------------------------------------------------------------------------
    def feed(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the conversation; return logits of the last one ([V]) or of all of them ([n, V])."""
        ids = [int(t) for t in ids]
        if not ids:
            raise TopqError("no tokens to feed")
        if self.length + len(ids) > self.seq_length:
            raise TopqError(f"context of {self.length + len(ids)} tokens exceeds seq_length {self.seq_length}")
        outputs: list[np.ndarray] = []
        pos = 0
        while pos < len(ids):
            if self.length == 0:
                chunk = ids[pos:pos + self.max_input_length]
                hidden = self._prefill(chunk)
            elif self.has_prefill_kv:
                chunk = ids[pos:pos + self.max_input_length]
                hidden = self._prefill_kv(chunk)
            else:
                chunk = ids[pos:pos + 1]
                hidden = self._decode_hidden(chunk[0])
            pos += len(chunk)
            if all_logits:
                outputs.append(self._logits_rows(hidden, len(chunk)))
            elif pos >= len(ids):
                outputs.append(self._logits_rows(hidden[:, len(chunk) - 1:len(chunk)], 1))
        if self.recurrent:
            self._saved[self.length] = [[a.copy() for a in layer] for layer in self.states]
            for length in sorted(self._saved)[:-SAVED_STATES]:
                del self._saved[length]
        logits = np.concatenate(outputs, axis=0)
        return logits if all_logits else logits[-1]

    def _logits_rows(self, hidden: np.ndarray, count: int) -> np.ndarray:
        """Logits [count, V] of the first `count` positions: one lm_head call on all of them when the executor
        takes several positions (`Executor` doc), else one call per position."""
        if count > 1 and getattr(self.executor, "lm_head_rows", False):
            with blas_threads(threads_for(count)):  # one [count, H] x [H, V] product
                return self._run("lm_head", [np.ascontiguousarray(hidden[:, :count])])[0][0]
        with blas_threads(threads_for(1)):  # lm_head runs one position per call
            rows = [self._run("lm_head", [np.ascontiguousarray(hidden[:, i:i + 1])])[0][0, 0] for i in range(count)]
        return np.stack(rows)

    def _padded(self, chunk: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        start = self.length
        ids = np.zeros((1, length), np.int32)
        ids[0, :len(chunk)] = chunk
        positions = np.minimum(np.arange(start, start + length), self.seq_length - 1).astype(np.int32)[None]
        return ids, positions

    @staticmethod
    def _kv(cache: list[np.ndarray | None], layer: int) -> np.ndarray:
        array = cache[layer]
        assert array is not None, f"layer {layer} carries states, not KV"
        return array

    def _store_kv(self, layer: int, k: np.ndarray, v: np.ndarray, count: int) -> None:
        start = self.length
        self._kv(self.k_cache, layer)[:, start:start + count] = k[:, :count]
        self._kv(self.v_cache, layer)[:, start:start + count] = v[:, :count]

    def _valid(self, count: int) -> np.ndarray:
        valid = np.zeros((1, self.max_input_length), np.float32)
        valid[0, :count] = 1
        return valid

    def _recurrent_block(self, name: str, layer: int, inputs: list[np.ndarray]) -> np.ndarray:
        """Run a recurrent layer's function on `inputs` + its states; keep the states it returns."""
        hidden, *states = self._run(name, inputs + self.states[layer])
        self.states[layer] = states
        return hidden

    def _prefill(self, chunk: Sequence[int]) -> np.ndarray:
        ids, positions = self._padded(chunk, self.max_input_length)
        with blas_threads(threads_for(self.max_input_length)):  # products of max_input_length rows (padded)
            (hidden,) = self._run("embedding", [ids])
            for layer in range(self.spec.num_layers):
                if self.state_shapes[layer]:
                    hidden, *self.states[layer] = self._run(f"block_{layer}", [hidden, positions,
                                                                               self._valid(len(chunk))])
                    continue
                hidden, k, v = self._run(f"block_{layer}", [hidden, positions])
                self._store_kv(layer, k, v, len(chunk))
        self.tokens.extend(chunk)
        return hidden

    def _prefill_kv(self, chunk: Sequence[int]) -> np.ndarray:
        L, S = self.max_input_length, self.seq_length
        ids, positions = self._padded(chunk, L)
        masks = {w: self._history_mask(S, L, w) for w in set(self.windows)}
        with blas_threads(threads_for(L)):
            (hidden,) = self._run("embedding", [ids])
            for layer in range(self.spec.num_layers):
                if self.state_shapes[layer]:
                    hidden = self._recurrent_block(f"block_kv_{layer}", layer, [hidden, positions,
                                                                                 self._valid(len(chunk))])
                    continue
                hidden, k, v = self._run(f"block_kv_{layer}", [hidden, positions, masks[self.windows[layer]],
                                                               self._kv(self.k_cache, layer),
                                                               self._kv(self.v_cache, layer)])
                self._store_kv(layer, k, v, len(chunk))
        self.tokens.extend(chunk)
        return hidden

    def _history_mask(self, slots: int, queries: int, window: int) -> np.ndarray:
        """The additive key mask of a history stage: `slots` cache rows (the first `self.length` filled) and
        `queries` new keys, which the attention itself hides causally. A sliding-window layer also hides the
        history its queries are too far from: query i (position length + i) sees slot j only when
        length + i - j < window, so its prefill-with-history mask has one row per query."""
        filled = self.length
        rows = queries if window and queries > 1 else 1
        mask = np.zeros((1, 1, rows, slots + queries), np.float32)
        mask[..., filled:slots] = NEG_INF  # unfilled history slots
        if window:
            i, j = np.arange(rows)[:, None], np.arange(slots)[None, :]
            mask[0, 0, :, :slots][j <= filled + i - window] = NEG_INF
        return mask

    def decode_variant(self, history: int) -> int:
        """The smallest decode variant whose history length holds `history` tokens."""
        for variant in self.decode_variants:
            if history <= variant:
                return variant
        raise TopqError(f"context of {history + 1} tokens exceeds seq_length {self.seq_length}")

    def _decode_hidden(self, token: int) -> np.ndarray:
        history = self.length
        if history + 1 > self.seq_length:
            raise TopqError(f"context of {history + 1} tokens exceeds seq_length {self.seq_length}")
        variant = self.decode_variant(history)
        suffix = "" if variant == self.seq_length else f"_{variant}"
        ids = np.array([[token]], np.int32)
        positions = np.array([[history]], np.int32)
        masks = {w: self._history_mask(variant, 1, w) for w in set(self.windows)}
        with blas_threads(threads_for(1)):  # one token: matrix-vector products, where threads only wait
            (hidden,) = self._run("embedding_cache", [ids])
            for layer in range(self.spec.num_layers):
                if self.state_shapes[layer]:  # no history to size: the one decode function
                    hidden = self._recurrent_block(f"block_cache_{layer}", layer, [hidden, positions])
                    continue
                hidden, k, v = self._run(f"block_cache_{layer}{suffix}", [
                    hidden, positions, masks[self.windows[layer]], self._kv(self.k_cache, layer)[:, :variant],
                    self._kv(self.v_cache, layer)[:, :variant]])
                self._store_kv(layer, k, v, 1)
        self.tokens.append(token)
        return hidden

    def decode(self, token: int) -> np.ndarray:
        """Feed one token through the decode stage; logits [V]."""
        hidden = self._decode_hidden(token)
        return self._logits_rows(hidden, 1)[0]

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling | None = None,
                 stop_ids: Sequence[int] | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (token, logits that chose it): the prompt's last logits first, then one per decode step."""
        sampling = sampling or Sampling()
        stop = set(self.spec.eos_token_ids if stop_ids is None else stop_ids)
        logits = self.feed(prompt)
        for step in range(max_new_tokens):
            token = sampling.pick(logits, self.tokens)
            yield token, logits
            if token in stop or step == max_new_tokens - 1 or self.length >= self.seq_length:
                return
            logits = self.decode(token)


class ChatSession:
    """Multi-turn chat with the tokenizer's chat template. Each turn re-renders the conversation and feeds only
    the tokens after the longest prefix the KV cache already holds, so earlier turns are never recomputed."""

    def __init__(self, bundle: Bundle, system: str | None = None, executor: Executor | None = None) -> None:
        self.session = Session(bundle, executor)
        self.tokenizer = bundle.tokenizer
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    def _render(self) -> list[int]:
        return list(self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def reply_stream(self, user_text: str, max_new_tokens: int = 128,
                     sampling: Sampling | None = None) -> Iterator[str]:
        self.messages.append({"role": "user", "content": user_text})
        ids = self._render()
        cached = self.session.tokens
        common = 0
        while common < min(len(cached), len(ids) - 1) and cached[common] == ids[common]:
            common += 1
        self.session.truncate(common)
        generated: list[int] = []
        printed = ""
        for token, _ in self.session.generate(ids[common:], max_new_tokens, sampling):
            if token in self.session.spec.eos_token_ids:
                break
            generated.append(token)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            yield text[len(printed):]
            printed = text
        self.messages.append({"role": "assistant", "content": printed})

    def reply(self, user_text: str, max_new_tokens: int = 128, sampling: Sampling | None = None) -> str:
        return "".join(self.reply_stream(user_text, max_new_tokens, sampling))


def perplexity(bundle: Bundle, ids: Sequence[int], window: int | None = None,
               executor: Executor | None = None) -> tuple[float, int]:
    """exp(mean negative log-likelihood) over independent windows; returns (perplexity, predicted tokens)."""
    from topq.core.progress import progress_bar

    session = Session(bundle, executor)
    window = min(window or session.seq_length, session.seq_length)
    if len(ids) < 2:
        raise TopqError("need at least two tokens for perplexity")
    total, count = 0.0, 0
    starts = range(0, len(ids) - 1, window)
    for start in progress_bar(starts, desc="eval", unit="window", disable=len(starts) < 2):
        chunk = list(ids[start:start + window])
        if len(chunk) < 2:
            break
        session.reset()
        targets = np.asarray(chunk[1:])
        total += token_nll(session.feed(chunk, all_logits=True)[:len(targets)], targets)
        count += len(targets)
    return float(np.exp(total / count)), count
