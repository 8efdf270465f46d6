"""The served CLIP preprocessing (image and text) against the libraries the models come with."""

from __future__ import annotations

import io

import numpy as np
import pytest

from forge.in_triton.encoder_models.image import ImagePreprocessor, decode_images
from forge.encoder.samples import synthetic_image


def images() -> list[bytes]:
    """Odd sizes both ways, grey, alpha, palette with transparency, JPEG, smaller than the crop."""
    from PIL import Image

    palette = Image.open(io.BytesIO(synthetic_image(90, 70, seed=7))).convert("P")
    palette.info["transparency"] = 0
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", transparency=0)
    return [synthetic_image(97, 131, seed=1), synthetic_image(300, 201, "L", seed=2),
            synthetic_image(64, 48, "RGBA", seed=3), buffer.getvalue(),
            synthetic_image(333, 251, seed=5, fmt="JPEG"), synthetic_image(40, 30, seed=6)]


def pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def served_preprocessor(repo_source, role="vision"):
    from forge.encoder.input_models import image_preprocessor

    return image_preprocessor(repo_source.interface(role))


def context(**options):
    """A BuildContext for calling the CLIP sources directly."""
    from pathlib import Path

    from forge.context import BuildContext, StageRecord
    from forge.spec import BuildSpec

    spec = BuildSpec(families=["clip"], model=Path("model"), out=Path("out"), options=options)
    return BuildContext(spec=spec, target="python", workdir=Path("work"), record=StageRecord("test", ""))


def source(path):
    from forge_clip import ADAPTER
    from forge_clip.sources import open_source

    return open_source(path, context(), ADAPTER)


def test_hf_clip_images_equal_the_pil_image_processor(hf_clip_model):
    """Exactly CLIPImageProcessorPil: composite alpha on white, shortest-edge bicubic, floor-centred crop."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(hf_clip_model, backend="pil")
    preprocess = served_preprocessor(source(hf_clip_model))
    for data in images():
        expected = processor(images=pil(data), return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(preprocess(data), expected, atol=1e-6)


def test_hf_clip_images_are_close_to_the_torchvision_image_processor(hf_clip_model):
    """transformers' default (torchvision) backend resizes on tensors: within about one grey level."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(hf_clip_model)
    preprocess = served_preprocessor(source(hf_clip_model))
    for data in images():
        expected = processor(images=pil(data), return_tensors="np")["pixel_values"][0]
        assert np.abs(preprocess(data) - expected).max() < 0.1  # normalised units; 1 grey level ≈ 0.015


def test_open_clip_images_equal_open_clips_transform(open_clip_model):
    """Exactly open_clip's eval transform: Resize, rounded CenterCrop (padding when small), then RGB."""
    import open_clip

    _, _, transform = open_clip.create_model_and_transforms(f"local-dir:{open_clip_model}")
    preprocess = served_preprocessor(source(open_clip_model))
    for data in images():
        np.testing.assert_allclose(preprocess(data), transform(pil(data)).numpy(), atol=1e-6)


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"definitely not an image", "not a decodable image"),
    (synthetic_image(64, 64)[:60], "not a decodable image"),  # truncated PNG
])
def test_undecodable_images_raise_value_errors(data, message):
    """Non-image bytes, empty and truncated files: ValueError (the served model answers INVALID_ARG)."""
    preprocess = ImagePreprocessor(resize_mode="shortest_edge", size=(32,), crop=(32, 32))
    with pytest.raises(ValueError, match=message):
        preprocess(data)


def test_decompression_bombs_are_refused():
    """Images above max_pixels are refused before they are decoded in full."""
    preprocess = ImagePreprocessor(resize_mode="shortest_edge", size=(32,), crop=(32, 32), max_pixels=1000)
    with pytest.raises(ValueError, match="too large"):
        preprocess(synthetic_image(200, 200))


def test_image_tensor_must_be_one_column():
    with pytest.raises(ValueError, match=r"shape \[batch, 1\]"):
        decode_images(np.array([b"a", b"b"], dtype=object))
    with pytest.raises(ValueError, match="empty batch"):
        decode_images(np.zeros((0, 1), dtype=object))


def test_served_clip_tokenizer_equals_open_clips(open_clip_model, tmp_path):
    """Cleaning (ftfy, HTML entities, whitespace, case), truncation to 77 with end-of-text, zero padding."""
    import open_clip

    from forge.encoder.encoder_options import EncoderOptions
    from forge.encoder.input_models import text_tokenizer

    src = source(open_clip_model)
    src.write_assets("text", tmp_path)
    tokenize = text_tokenizer(src.interface("text"), EncoderOptions.read(context()), tmp_path)
    texts = ["A photo of a CAT", "", "<b>bold</b> &amp; stuff", "  many   spaces\tand\nlines ",
             "naïve café 123 😀", "It's a dog's life!", "word " * 200]
    expected = open_clip.get_tokenizer(f"local-dir:{open_clip_model}")(texts).numpy()
    np.testing.assert_array_equal(tokenize(texts)["input_ids"], expected)


def test_served_clip_tokenizer_equals_the_hf_tokenizer(hf_clip_model, tmp_path):
    from transformers import AutoTokenizer

    from forge.encoder.encoder_options import EncoderOptions
    from forge.encoder.input_models import text_tokenizer

    src = source(hf_clip_model)
    src.write_assets("text", tmp_path)
    tokenize = text_tokenizer(src.interface("text"), EncoderOptions.read(context()), tmp_path)
    texts = ["A photo of a CAT", "", "  many   spaces ", "word " * 200]
    expected = AutoTokenizer.from_pretrained(hf_clip_model)(texts, padding="max_length", truncation=True,
                                                           max_length=77, return_tensors="np")["input_ids"]
    np.testing.assert_array_equal(tokenize(texts)["input_ids"], expected)
