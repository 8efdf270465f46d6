"""Triton python-backend model: encoded images (JPEG, PNG, …) → the vision tower's pixel tensor.

Input ``image`` (STRING: the file's bytes, one image per batch row); output ``pixel_values`` (FP32,
[3, H, W]). The recipe (resize, centre crop, RGB conversion, rescale, normalise) is the model's own
processor's, read from this model's config parameters: Hugging Face's PIL image processors
(``CLIPImageProcessorPil``) and open_clip's torchvision-on-PIL transforms are reproduced exactly;
the only difference between the two is where the RGB conversion happens and how the crop offset rounds.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

try:  # the build imports this module as part of forge.in_triton
    from .. import forge_glue
except ImportError:  # inside a repository it sits next to forge_glue.py
    import forge_glue

RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",")) if text else ()


class ImagePreprocessor:
    """Decode and preprocess one image exactly as the model's processor does."""

    def __init__(self, *, resize_mode: str, size: tuple[int, ...], crop: tuple[int, ...] = (),
                 crop_rounding: str = "floor", resample: str = "bicubic", rgb: str = "convert",
                 rgb_step: str = "first", rescale: float = 1 / 255, mean: tuple[float, ...] = (0.0, 0.0, 0.0),
                 std: tuple[float, ...] = (1.0, 1.0, 1.0), max_pixels: int = 89_478_485):
        if resize_mode not in ("shortest_edge", "exact", "none"):
            raise ValueError(f"unknown resize_mode {resize_mode!r}")
        if crop_rounding not in ("floor", "round") or rgb not in ("convert", "composite_white") \
                or rgb_step not in ("first", "last") or resample not in RESAMPLE:
            raise ValueError("invalid image preprocessing settings")
        self.resize_mode, self.size, self.crop = resize_mode, tuple(size), tuple(crop)
        self.crop_rounding, self.resample, self.rgb, self.rgb_step = crop_rounding, resample, rgb, rgb_step
        self.rescale = rescale
        self.mean = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(std, dtype=np.float32).reshape(3, 1, 1)
        self.max_pixels = max_pixels

    def decode(self, data: bytes):
        """Bytes → a fully loaded PIL image; ValueError for anything that is not a readable image."""
        from PIL import Image

        if not data:
            raise ValueError("the image is empty (0 bytes)")
        Image.MAX_IMAGE_PIXELS = self.max_pixels
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                image = Image.open(io.BytesIO(data))
                image.load()
            except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
                raise ValueError(f"the image is too large ({exc})") from None
            except Image.UnidentifiedImageError:
                raise ValueError("not a decodable image (unknown or unsupported format)") from None
            except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt files
                raise ValueError(f"not a decodable image ({exc})") from None
        return image

    def _to_rgb(self, image):
        from PIL import Image

        if self.rgb == "composite_white":  # Hugging Face: transparency is composited onto white
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(background, rgba).convert("RGB")
        return image if image.mode == "RGB" else image.convert("RGB")

    def _resized(self, image):
        width, height = image.size
        if self.resize_mode == "shortest_edge":
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.size[0], int(self.size[0] * long / short)
            new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        elif self.resize_mode == "exact":
            new_h, new_w = self.size
        else:
            return image
        return image.resize((new_w, new_h), resample=RESAMPLE[self.resample])

    def _offset(self, size: int, crop: int) -> int:
        # Hugging Face floors the centre offset; torchvision rounds it (and pads the other way).
        if size >= crop:
            return (size - crop) // 2 if self.crop_rounding == "floor" else int(round((size - crop) / 2.0))
        pad = crop - size
        return -((pad + 1) // 2) if self.crop_rounding == "floor" else -(pad // 2)

    def __call__(self, data: bytes) -> np.ndarray:
        image = self.decode(data)
        if self.rgb_step == "first":
            image = self._to_rgb(image)
        image = self._resized(image)
        if self.crop:
            crop_h, crop_w = self.crop
            top, left = self._offset(image.size[1], crop_h), self._offset(image.size[0], crop_w)
            image = image.crop((left, top, left + crop_w, top + crop_h))  # outside the image is black
        if self.rgb_step == "last":
            image = self._to_rgb(image)
        array = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        pixels = (array.astype(np.float64) * self.rescale).astype(np.float32)
        return (pixels - self.mean) / self.std

    def batch(self, images: list[bytes]) -> np.ndarray:
        return np.stack([self(data) for data in images]).astype(np.float32)


def decode_images(raw: np.ndarray) -> list[bytes]:
    """A STRING tensor of shape [batch, 1] → one bytes object per row."""
    if raw.ndim != 2 or raw.shape[1] != 1:
        raise ValueError(f"image must have shape [batch, 1], got {list(raw.shape)}")
    if raw.shape[0] == 0:
        raise ValueError("the request holds no images (empty batch)")
    return [v if isinstance(v, bytes) else str(v).encode() for v in raw.reshape(-1)]


def from_parameters(params: dict[str, str]) -> ImagePreprocessor:
    """Build the preprocessor from the model config's parameters (all strings)."""
    return ImagePreprocessor(
        resize_mode=params["resize_mode"], size=_ints(params.get("size", "")), crop=_ints(params.get("crop", "")),
        crop_rounding=params.get("crop_rounding", "floor"), resample=params.get("resample", "bicubic"),
        rgb=params.get("rgb", "convert"), rgb_step=params.get("rgb_step", "first"),
        rescale=float(params.get("rescale", repr(1 / 255))), mean=_floats(params["mean"]),
        std=_floats(params["std"]), max_pixels=int(params.get("max_pixels", "89478485")))




class TritonPythonModel:
    """Triton's entry point."""

    def initialize(self, args):
        self.preprocess = from_parameters(forge_glue.parameters(forge_glue.model_config(args)))

    def execute(self, requests):
        return forge_glue.run_each(requests, self._preprocess, "image preprocessing")

    def _preprocess(self, request):
        pixels = []
        for row, data in enumerate(decode_images(forge_glue.get(request, "image"))):
            try:
                pixels.append(self.preprocess(data))
            except ValueError as exc:
                raise ValueError(f"image {row}: {exc}") from None
        return {"pixel_values": np.stack(pixels).astype(np.float32)}
