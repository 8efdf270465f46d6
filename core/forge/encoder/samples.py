"""Inputs for parity checks and calibration: built-in sample texts and images, or --calib-data."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ..errors import UsageError

#: Parity texts: empty, short, punctuation/unicode, and one longer than any tower's max length.
PARITY_TEXTS = (
    "",
    "Hello world",
    "A photo of a cat sitting on a red sofa.",
    "Triton serves ONNX, TensorRT and Python models — with dynamic batching!",
    " leading and trailing spaces ",
    "The quick brown fox jumps over the lazy dog. " * 60,  # ~600 tokens: truncated
)

#: Calibration texts when no --calib-data is given: varied lengths and topics.
CALIBRATION_TEXTS = (
    "What is machine learning?",
    "The weather today is sunny with a light breeze from the west.",
    "Sentence embeddings map text to vectors so that similar meanings are close together.",
    "A dog runs across the field chasing a yellow ball.",
    "Quarterly revenue grew by twelve percent compared to the previous year.",
    "How do I reset my password if I no longer have access to my email?",
    "The mitochondria is the powerhouse of the cell.",
    "Paris is the capital and most populous city of France.",
    "Please turn off the lights when you leave the room.",
    "GPU inference servers batch requests dynamically to improve throughput.",
    "She played a beautiful piece on the piano at the concert last night.",
    "Symptoms include fever, cough and shortness of breath.",
    "The committee postponed the decision until more data becomes available.",
    "A red car is parked next to a blue bicycle on a narrow street.",
    "Convert the temperature from Celsius to Fahrenheit.",
    "Stock markets fell sharply after the announcement of new tariffs.",
    "Two children are building a sandcastle on the beach.",
    "Install the package with pip and run the tests before committing.",
    "The novel explores themes of memory, loss and reconciliation.",
    "Cats often sleep for more than twelve hours a day.",
    "An apple a day keeps the doctor away.",
    "The train to Berlin departs from platform nine at half past eight.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Return policy: items can be returned within thirty days with a receipt.",
    "A man in a black jacket is reading a newspaper at the station.",
    "Transformers use self-attention to relate every token to every other token.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Hiking trails in the national park close at sunset during winter.",
    "Why is the sky blue?",
    "Large language models can summarise long documents.",
    "The museum's new exhibition features impressionist paintings.",
    "Please confirm your appointment by replying to this message.",
)


def synthetic_image(width: int, height: int, mode: str = "RGB", seed: int = 0, fmt: str = "PNG") -> bytes:
    """An encoded image with gradients, edges and noise (exercises resize and crop like a photo)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), ((x + y) % 17) / 16.0], axis=-1)
    block = ((x // 7 + y // 5) % 2)[..., None] * 0.25
    pixels = np.clip((base + block) * 200 + rng.normal(0, 12, size=base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":
        alpha = (np.clip(x / max(width - 1, 1), 0, 1) * 255).astype(np.uint8)
        image = Image.fromarray(np.dstack([pixels, alpha]), "RGBA")
    elif mode != "RGB":
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def parity_images() -> list[list[bytes]]:
    """Batches of images for export parity: odd sizes, portrait/landscape, grey, alpha, JPEG."""
    return [
        [synthetic_image(97, 131, seed=1), synthetic_image(300, 200, "L", seed=2),
         synthetic_image(64, 48, "RGBA", seed=3)],
        [synthetic_image(256, 256, seed=4, fmt="JPEG")],
    ]


def calibration_texts(path: Path | None, limit: int) -> tuple[list[str], str]:
    """Calibration texts (one per line of ``path``) and a description of where they came from."""
    if path is None:
        texts = list(CALIBRATION_TEXTS)
        return (texts * (limit // len(texts) + 1))[:limit], "built-in sample sentences"
    if path.is_dir():
        raise UsageError(f"--calib-data {path} is a directory; text towers need a text file, one sample per line")
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --calib-data {path}: {exc}") from None
    texts = [line for line in lines if line][:limit]
    if not texts:
        raise UsageError(f"--calib-data {path} holds no text lines")
    return texts, f"{path} ({len(texts)} lines)"


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def calibration_images(path: Path | None, limit: int) -> tuple[list[bytes], str]:
    """Calibration images: a directory of image files, or a text file listing image paths."""
    if path is None:
        images = [synthetic_image(96 + 13 * i, 80 + 7 * (i % 9), ("RGB", "L", "RGBA")[i % 3], seed=100 + i)
                  for i in range(min(limit, 16))]
        return images, "synthetic images (pass --calib-data DIR with real images for better int8 ranges)"
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    else:
        try:
            names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --calib-data {path}: {exc}") from None
        files = [p if p.is_absolute() else path.parent / p for p in map(Path, names)]
    files = files[:limit]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UsageError(f"--calib-data lists {missing[0]}, which does not exist")
    if not files:
        raise UsageError(f"--calib-data {path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return [f.read_bytes() for f in files], f"{path} ({len(files)} images)"
