"""The preprocessing models' settings, as Triton config parameters and as in-process objects.

The build runs the very code the server runs (``forge.in_triton.encoder_models``), configured from the same
string parameters, so parity samples are prepared exactly as served requests will be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .adapter import TEXT, TowerInterface
from .encoder_options import EncoderOptions

TOKENIZER_FILE = "tokenizer.json"


def _string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_string(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def text_padding(iface: TowerInterface, opts: EncoderOptions) -> str:
    """Fixed-context towers (CLIP) always pad to their length; others follow ``-o padding``."""
    return "max_length" if iface.preprocessing.get("fixed_length") else opts.padding


def text_parameters(iface: TowerInterface, opts: EncoderOptions) -> dict[str, str]:
    pp = iface.preprocessing
    return {"tokenizer_file": TOKENIZER_FILE, "max_length": _string(pp["max_length"]),
            "padding": text_padding(iface, opts), "pad_id": _string(pp.get("pad_id", 0)),
            "lowercase": _string(bool(pp.get("lowercase", False))), "clean": pp.get("clean", "none"),
            "outputs": ",".join(t.name for t in iface.inputs)}


IMAGE_KEYS = ("resize_mode", "size", "crop", "crop_rounding", "resample", "rgb", "rgb_step", "rescale", "mean", "std")


def image_parameters(iface: TowerInterface) -> dict[str, str]:
    pp = iface.preprocessing
    return {key: _string(pp[key]) for key in IMAGE_KEYS if key in pp and pp[key] is not None}


def parameters(iface: TowerInterface, opts: EncoderOptions) -> dict[str, str]:
    """The preprocessing model's config parameters."""
    return text_parameters(iface, opts) if iface.modality == TEXT else image_parameters(iface)


def text_tokenizer(iface: TowerInterface, opts: EncoderOptions, assets: Path):
    """The served tokenizer, in process."""
    from ..in_triton.encoder_models import tokenizer

    return tokenizer.from_parameters(text_parameters(iface, opts), str(assets))


def image_preprocessor(iface: TowerInterface):
    """The served image preprocessing, in process."""
    from ..in_triton.encoder_models import image

    return image.from_parameters(image_parameters(iface))
