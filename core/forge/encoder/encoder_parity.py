"""Parity of an exported (or quantized) encoder against torch: samples, measures, verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ForgeError

Feeds = dict[str, np.ndarray]
SAMPLES_FILE = "parity.npz"


def measure(reference: list[np.ndarray], actual: list[np.ndarray]) -> dict[str, Any]:
    """Max abs difference and cosine similarity of every embedding row."""
    ref = np.concatenate([r.reshape(len(r), -1) for r in reference]).astype(np.float64)
    act = np.concatenate([a.reshape(len(a), -1) for a in actual]).astype(np.float64)
    if ref.shape != act.shape:
        raise ForgeError(f"parity: output shape {list(act.shape)} differs from torch's {list(ref.shape)}")
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(act, axis=1)
    cosine = np.sum(ref * act, axis=1) / np.maximum(norms, 1e-30)
    diff = float(np.max(np.abs(ref - act)))
    scale = max(1.0, float(np.max(np.abs(ref))))
    return {"max_abs_diff": diff, "scale": scale, "scaled_diff": diff / scale, "min_cosine": float(np.min(cosine)),
            "mean_cosine": float(np.mean(cosine)), "rows": int(len(ref)), "finite": bool(np.isfinite(act).all())}


def check(stats: dict[str, Any], tolerance: float, what: str, hint: str) -> None:
    """Fail the build when the difference is past the tolerance (or not finite).

    The tolerance bounds the max abs diff divided by max(1, largest |value| torch produced): an
    absolute bound for normalised embeddings, a relative one for unnormalised CLIP features.
    """
    if not stats["finite"] or not stats["scaled_diff"] <= tolerance:
        raise ForgeError(f"{what}: max abs diff {stats['max_abs_diff']:.3g} against torch (scale "
                         f"{stats['scale']:.3g}) exceeds the tolerance {tolerance:g} "
                         f"(min cosine {stats['min_cosine']:.6f})", hint=hint)


def save(path: Path, samples: list[Feeds], reference: list[np.ndarray]) -> None:
    """Store parity inputs and torch's outputs, so later stages compare without torch."""
    arrays = {}
    for index, (feeds, ref) in enumerate(zip(samples, reference)):
        arrays.update({f"{index}/{name}": value for name, value in feeds.items()})
        arrays[f"{index}//reference"] = ref
    np.savez(path, **arrays)


def load(path: Path) -> tuple[list[Feeds], list[np.ndarray]]:
    with np.load(path) as data:
        count = 1 + max(int(key.split("/")[0]) for key in data.files)
        samples: list[Feeds] = [{} for _ in range(count)]
        reference: list[np.ndarray] = [np.empty(0)] * count
        for key in data.files:
            index, _, name = key.partition("/")
            if name == "/reference":
                reference[int(index)] = data[key]
            else:
                samples[int(index)][name] = data[key]
    return samples, reference


def onnxruntime_outputs(model: Path, samples: list[Feeds]) -> list[np.ndarray]:
    """Run an ONNX file with ONNX Runtime on CPU, one output array per sample batch."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return [session.run(None, feeds)[0] for feeds in samples]
