"""Float32 host bundles of tiny models and of SmolLM2: the stage settings and the converter the fixtures use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

#: Stage settings of the tiny host bundles (DESIGN §2): three decode variants 16, 32 and 64.
TINY_STAGES: dict[str, Any] = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [16, 32]}
SMOL_STAGES: dict[str, Any] = {"seq_length": 512, "max_input_length": 128, "decode_chunks": [128, 256]}

#: The session fixture `tiny_checkpoint(kind, directory) -> model` (tests/conftest.py).
TinyCheckpoint = Callable[[str, Path], Any]


class TinyHost(NamedTuple):
    """A tiny float32 transformers model and the host bundle converted from its saved checkpoint."""

    model: Any  # a transformers *ForCausalLM in eval mode
    bundle: Any  # topq.core.bundle.Bundle

    @property
    def checkpoint(self) -> Path:
        return Path(self.bundle.recipe["model"]["path"])


def convert_host(checkpoint: Path | str, output: Path, **stages: Any) -> Any:
    """Convert a checkpoint to a float32 host bundle with the given stage settings; return the opened Bundle."""
    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": "f32"}, target={"chip": "host"},
                                  stages=stages, output={"path": str(output)})
    convert(recipe, progress=False)
    return Bundle(output)
