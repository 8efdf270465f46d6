"""Hugging Face checkpoint directories: checked before any stage reads them (safe by default)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UsageError

PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


@dataclass
class HFCheckpoint:
    """A checked checkpoint directory: its config and weight files."""

    path: Path
    config: dict[str, Any]
    weight_files: list[Path] = field(default_factory=list)
    weight_format: str = "safetensors"  # or "pickle" (only with allow_pickle)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else ""

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")


def read_json(path: Path, what: str = "file") -> dict[str, Any]:
    """Read a json object; any problem is a one-line UsageError naming the file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{path} is missing ({what})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{path} is not valid json: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a json object, not {type(data).__name__}")
    return data


def safetensors_header(path: Path) -> dict[str, Any]:
    """Parse a safetensors header and check the file holds every byte it declares."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise UsageError(f"{path} is truncated (no safetensors header)")
        (length,) = struct.unpack("<Q", raw)
        if length > size - 8 or length > 100 * 1024 * 1024:
            raise UsageError(f"{path} is truncated or not a safetensors file (header length {length})")
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            raise UsageError(f"{path} has a corrupt safetensors header") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise UsageError(f"{path} is truncated: header declares {8 + length + end} bytes, file has {size}")
    return header


def inspect_checkpoint(path: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False,
                       require_weights: bool = True) -> HFCheckpoint:
    """Check a checkpoint directory and return its config and weight files.

    Refuses, with one line each: missing/empty directory, missing or invalid config.json, configs that
    need custom code without ``trust_remote_code``, truncated safetensors, missing index shards, and
    pickle-only weights without ``allow_pickle``.
    """
    if not path.exists():
        raise UsageError(f"model path {path} does not exist")
    if not path.is_dir():
        raise UsageError(f"model path {path} is not a directory")
    if not any(path.iterdir()):
        raise UsageError(f"model directory {path} is empty")
    config = read_json(path / "config.json", "the model config")
    if config.get("auto_map") and not trust_remote_code:
        raise UsageError(f"{path}/config.json needs custom code (auto_map: {', '.join(config['auto_map'])})",
                         hint="pass --trust-remote-code if you trust this checkpoint")
    checkpoint = HFCheckpoint(path, config)
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index, "the safetensors index").get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise UsageError(f"{index} lists shards that are missing: {', '.join(missing)}")
        checkpoint.weight_files = [path / s for s in shards]
    else:
        checkpoint.weight_files = sorted(path.glob("*.safetensors"))
    for file in checkpoint.weight_files:
        safetensors_header(file)
    if not checkpoint.weight_files:
        pickles = sorted(p for pattern in PICKLE_PATTERNS for p in path.glob(pattern))
        if pickles and not allow_pickle:
            raise UsageError(f"{path} has only pickle weights ({pickles[0].name}); loading pickle can run "
                             "arbitrary code", hint="convert them to safetensors, or pass --allow-pickle")
        if pickles:
            checkpoint.weight_files, checkpoint.weight_format = pickles, "pickle"
        elif require_weights:
            raise UsageError(f"{path} has no weights (*.safetensors)")
    return checkpoint
