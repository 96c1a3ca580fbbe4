"""Tokenizers as text: the files a Hugging Face fast tokenizer saves, as {filename: text}, so a tokenizer travels
inside a checkpoint description or a bundle without pickle and is rebuilt offline, never with code."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from topq.ir.errors import TopqError

__all__ = ["load_tokenizer", "tokenizer_files_of"]


def tokenizer_files_of(tokenizer: Any) -> dict[str, str]:
    """The text files `tokenizer.save_pretrained` writes, as {filename: text}."""
    with tempfile.TemporaryDirectory(prefix="topq-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        files: dict[str, str] = {}
        for path in sorted(Path(tmp).iterdir()):
            if not path.is_file() or path.suffix == ".py":  # code never travels in a bundle
                continue
            try:
                files[path.name] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue  # binary extras (e.g. a sentencepiece model) are not part of the contract
    if "tokenizer_config.json" in files:
        # transformers records where the tokenizer was loaded from; meaningless once bundled.
        cfg = json.loads(files["tokenizer_config.json"])
        for key in ("is_local", "local_files_only", "name_or_path"):
            cfg.pop(key, None)
        files["tokenizer_config.json"] = json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"
    return files


def _has_auto_map(config_text: str) -> bool:
    try:
        doc = json.loads(config_text)
    except ValueError:
        return False  # not JSON: transformers reports it
    return isinstance(doc, dict) and "auto_map" in doc


def load_tokenizer(files: Mapping[str, str]) -> Any:
    """Rebuild a transformers tokenizer from `Checkpoint.tokenizer_files` (offline)."""
    if not files:
        raise TopqError("no tokenizer: the checkpoint carries no tokenizer files")
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

    with tempfile.TemporaryDirectory(prefix="topq-tok-") as tmp:
        for name, text in files.items():
            # Names may come from a bundle: refuse anything that would leave the temp dir, and code.
            if not name or Path(name).name != name or name in (".", ".."):
                raise TopqError(f"bad tokenizer file name {name!r}")
            if name.endswith(".py") or (name == "tokenizer_config.json" and _has_auto_map(text)):
                raise TopqError(f"the tokenizer carries code ({name}); topq never runs code from a checkpoint "
                                "or bundle")
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        try:
            return AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # transformers raises many kinds; the user needs one line
            raise TopqError(f"cannot rebuild the tokenizer from {sorted(files)}: {exc}") from exc
