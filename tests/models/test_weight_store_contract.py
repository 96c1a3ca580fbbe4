"""The WeightStore contract: every method callers use is declared, `BaseWeightStore` supplies the optional ones,
and a checkpoint whose store lacks part of the contract is refused in one line when it opens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

import topq
from topq.core.checkpoint import BaseWeightStore, Checkpoint, CheckpointFormat, WeightStore
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.pipeline import open_checkpoint
from topq.core.plugins import build_plugins


class ArrayStore(BaseWeightStore):
    """The smallest store: only the required methods."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def names(self) -> list[str]:
        return list(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def dtype(self, name: str) -> str:
        return self.arrays[name].dtype.name

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def get(self, name: str) -> np.ndarray:
        return self.arrays[name].astype(np.float32)

    def get_raw(self, name: str) -> np.ndarray:
        return self.arrays[name]


class DuckStore:
    """A store that predates read_raw / quantized / fingerprint and does not derive from BaseWeightStore."""

    def names(self) -> list[str]:
        return []

    def shape(self, name: str) -> tuple[int, ...]:
        return ()

    def dtype(self, name: str) -> str:
        return "float32"

    def __contains__(self, name: object) -> bool:
        return False

    def get(self, name: str) -> np.ndarray:
        return np.zeros(())

    def get_raw(self, name: str) -> np.ndarray:
        return np.zeros(())


def test_base_store_defaults() -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    store = ArrayStore({"w": w})
    assert isinstance(store, WeightStore)
    assert store.read_raw("w") is None and store.quantized("w") is None and store.dequantized_bits("w") is None
    assert store.fingerprint("w") == hashlib.sha256(w.tobytes()).hexdigest()
    store.arrays["w"] = w + 1
    assert store.fingerprint("w") != hashlib.sha256(w.tobytes()).hexdigest()


def test_a_store_missing_contract_methods_is_refused(tmp_path: Path) -> None:
    class Plugin:
        @topq.hookimpl
        def register_checkpoint_formats(self, register: Register[CheckpointFormat]) -> None:
            # DuckStore is not a WeightStore: that is the point (a static checker would refuse it too).
            register(CheckpointFormat("duck", lambda p: p.suffix == ".duck",
                                      lambda p: Checkpoint(p, "duck", {}, DuckStore())))  # type: ignore[arg-type]

    (tmp_path / "m.duck").write_text("")
    plugins = build_plugins(extra=(Plugin(),))
    with pytest.raises(TopqError) as info:
        open_checkpoint(plugins, tmp_path / "m.duck")
    message = str(info.value)
    assert message == ("checkpoint format duck: its weight store lacks read_raw, quantized, dequantized_bits, "
                       "fingerprint (derive it from topq.core.checkpoint.BaseWeightStore)")


def test_safetensors_store_reads_privately_and_fingerprints_without_reading(tmp_path: Path) -> None:
    from topq.io.safetensors import write_safetensors
    from topq.plugins.formats.hf import open_checkpoint as open_hf

    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_safetensors(tmp_path / "model.safetensors", [("a.weight", w)], {})
    (tmp_path / "config.json").write_text("{}")
    store = open_hf(tmp_path).weights
    raw = store.read_raw("a.weight")
    assert raw is not None and raw.flags.writeable and np.array_equal(raw, w)
    assert store.quantized("a.weight") is None
    before = store.fingerprint("a.weight")
    assert str((tmp_path / "model.safetensors").resolve()) in before
    write_safetensors(tmp_path / "model.safetensors", [("a.weight", np.zeros((3, 5), np.float32))], {})
    assert open_hf(tmp_path).weights.fingerprint("a.weight") != before  # the size changed


def test_family_mapping_keeps_the_dequantized_width_of_row_blocks() -> None:
    """A fused GGUF tensor split into rows keeps its width (blocks never span rows); a transformed one has none."""
    from topq.core.spec import ModelSpec
    from topq.models.weightmap import AddScalar, MappedWeights, Rows

    class Q41Store(ArrayStore):
        def dequantized_bits(self, name: str) -> int | None:
            return 4 if name.endswith("gate_up") else None

    base = Q41Store({"l.0.gate_up": np.zeros((8, 32), np.float32), "norm": np.zeros(4, np.float32)})
    spec = ModelSpec(family="t", architecture="T", hidden_size=4, intermediate_size=4, num_layers=1, num_heads=2,
                     num_kv_heads=2, head_dim=2, vocab_size=10)
    store = MappedWeights(base, {"l.{i}.gate": Rows("l.{i}.gate_up", 2, 0), "l.{i}.up": Rows("l.{i}.gate_up", 2, 1),
                                 "norm": AddScalar("norm", 1.0)}, spec, "t")
    assert [store.dequantized_bits(n) for n in ("l.0.gate", "l.0.up", "norm")] == [4, 4, None]
