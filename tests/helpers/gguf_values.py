"""Writing GGUF metadata values of any Python type (tests that craft GGUF files with the `gguf` library)."""

from __future__ import annotations

from typing import Any


def add_value(writer: Any, key: str, value: Any) -> None:
    """Add `value` under `key` with the GGUF type its Python type suggests (negative integers as int32)."""
    from gguf import GGUFValueType

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int32(key, value) if value < 0 else writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif value and min(value) < 0:
        writer.add_key_value(key, value, GGUFValueType.ARRAY)
    else:
        writer.add_array(key, value)
