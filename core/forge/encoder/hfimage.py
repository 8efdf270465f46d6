"""Hugging Face ``CLIPImageProcessor`` settings (``preprocessor_config.json``) as forge's image recipe.

Shared by every family whose checkpoints carry CLIP's image processor (CLIP, LLaVA's vision tower);
the recipe's keys are those of :mod:`forge.in_triton.encoder_models.image`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..hf import read_json

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def pair(value: Any, what: str) -> tuple[int, int]:
    """An image size given as an int, ``{"height", "width"}`` or a 2-list, as (height, width)."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise UsageError(f"cannot read {what} {value!r}")


def clip_image_recipe(path: Path, image_size: int) -> dict[str, Any]:
    """CLIPImageProcessor's settings from ``path/preprocessor_config.json`` (its defaults when absent)."""
    file = path / "preprocessor_config.json"
    cfg = read_json(file, "the image processor config") if file.is_file() else {}
    size = cfg.get("size", {"shortest_edge": image_size})
    if isinstance(size, dict) and "shortest_edge" in size:
        resize = {"resize_mode": "shortest_edge", "size": [int(size["shortest_edge"])]}
    elif isinstance(size, int):
        resize = {"resize_mode": "shortest_edge", "size": [size]}
    else:
        resize = {"resize_mode": "exact", "size": list(pair(size, "image processor size"))}
    if not cfg.get("do_resize", True):
        resize = {"resize_mode": "none", "size": []}
    crop = list(pair(cfg.get("crop_size", image_size), "crop_size")) if cfg.get("do_center_crop", True) else None
    return {**resize, "crop": crop, "crop_rounding": "floor",
            "resample": PIL_RESAMPLE.get(cfg.get("resample", 3), "bicubic"),
            "rgb": "composite_white", "rgb_step": "first",
            "rescale": float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else 1.0,
            "mean": list(cfg.get("image_mean", OPENAI_MEAN)) if cfg.get("do_normalize", True) else [0.0] * 3,
            "std": list(cfg.get("image_std", OPENAI_STD)) if cfg.get("do_normalize", True) else [1.0] * 3,
            "processor": "preprocessor_config.json" if cfg else "CLIPImageProcessor defaults"}
