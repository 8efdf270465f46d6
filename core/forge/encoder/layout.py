"""The layout of an encoder artifact directory, the same after every stage.

``onnx/model.onnx`` (plus external data, if any), ``assets/`` (tokenizer.json), ``parity.npz``
(parity inputs and torch's outputs), ``model.plan`` (tensorrt target), ``calibration.cache``
(tensorrt int8). ``Artifact.meta["interface"]`` holds the tower interface.
"""

from __future__ import annotations

from pathlib import Path

from ..publish import place

ONNX_DIR = "onnx"
ONNX_FILE = "model.onnx"
ASSETS = "assets"
PLAN = "model.plan"
CALIBRATION = "calibration.cache"


def onnx_path(root: Path) -> Path:
    return root / ONNX_DIR / ONNX_FILE


def carry(src: Path, dst: Path, *names: str) -> None:
    """Hard-link (or copy) the named entries of a previous artifact into a new one."""
    for name in names:
        if (src / name).exists():
            place(src / name, dst / name)
