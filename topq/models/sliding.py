"""Sliding-window settings shared by the Qwen2 / Qwen3 configs: `use_sliding_window` turns the window on for the
layers from `max_window_layers` on (as transformers builds `layer_types`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from topq.models.decoder import DECODER_FIELDS, layer_windows

#: Qwen2 / Qwen3 MLPs have no biases; the window fields are read by `qwen_windows`.
QWEN_WINDOW_FIELDS = DECODER_FIELDS - {"mlp_bias"} | {"sliding_window", "use_sliding_window", "layer_types"}


def qwen_windows(config: Mapping[str, Any]) -> tuple[int, ...]:
    if not config.get("use_sliding_window"):
        return ()  # transformers drops sliding_window (and so every window) without it
    first = int(config.get("max_window_layers") or 0)
    return layer_windows(config, lambda layer: layer >= first)
