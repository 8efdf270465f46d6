"""One part of a composite checkpoint as a Hugging Face checkpoint of its own.

A composite family (LLaVA: vision tower + projector + language model) hands its language model to
the plugin that owns that architecture. That plugin reads a plain checkpoint directory, so the part
is written as one: ``config.json`` (the part's config), the tokenizer files, and safetensors shards
holding only the part's tensors under the names the plain model uses. Tensor bytes are copied as
they are (no dtype conversion), one tensor at a time, so memory does not grow with the model.
The result is cached by the source's fingerprint: a second build reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Mapping

from .cache import cache_dir, fingerprint, source_fingerprint
from .errors import UsageError
from .hf import inspect_checkpoint, safetensors_header

#: Renames a source tensor name to the part's name, or returns None when the tensor is not the part's.
Rename = Callable[[str], "str | None"]
_COPY_BYTES = 64 << 20


def extract(source: Path, config: Mapping[str, Any], rename: Rename, *, what: str,
            extra_files: tuple[str, ...] = (), root: Path | None = None) -> Path:
    """The directory holding the part of ``source`` that ``rename`` selects (written once, then cached)."""
    checkpoint = inspect_checkpoint(source)
    key = fingerprint("subcheckpoint", what, source_fingerprint(source), dict(config))
    dest = (root or cache_dir() / "parts") / f"{what}-{key[:16]}"
    if (dest / "config.json").is_file():
        return dest
    staging = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        weight_map: dict[str, str] = {}
        for index, shard in enumerate(checkpoint.weight_files):
            name = f"model-{index + 1:05d}.safetensors"
            written = _copy_shard(shard, staging / name, rename)
            if not written:
                (staging / name).unlink()
            weight_map.update({tensor: name for tensor in written})
        if not weight_map:
            raise UsageError(f"{source} holds no tensors of its {what}")
        (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        for name in extra_files:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        (staging / "config.json").write_text(json.dumps(dict(config), indent=2))
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _copy_shard(src: Path, dst: Path, rename: Rename) -> list[str]:
    """Write the selected tensors of one safetensors file, renamed, byte for byte; returns their names."""
    header = safetensors_header(src)
    chosen = [(new, old, header[old]) for old in header if old != "__metadata__"
              for new in [rename(old)] if new is not None]
    out: dict[str, Any] = {"__metadata__": header.get("__metadata__") or {"format": "pt"}}
    position = 0
    for new, _, info in chosen:
        start, end = info["data_offsets"]
        out[new] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [position, position + end - start]}
        position += end - start
    blob = json.dumps(out, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(src, "rb") as fin:
        (length,) = struct.unpack("<Q", fin.read(8))
        data_start = 8 + length
        with open(dst, "wb") as fout:
            fout.write(struct.pack("<Q", len(blob)) + blob)
            for _, _, info in chosen:
                start, end = info["data_offsets"]
                fin.seek(data_start + start)
                left = end - start
                while left:
                    chunk = fin.read(min(left, _COPY_BYTES))
                    fout.write(chunk)
                    left -= len(chunk)
    return [new for new, _, _ in chosen]
