"""A tiny random LLaVA-1.5 (CLIP vision tower, 2-layer GELU projector, Llama) with a real tokenizer, offline."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "decoders"))

import tiny_tokenizers  # noqa: E402

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH = 32, 8  # 16 patches: 16 visual tokens (strategy "default"), 17 with "full"


def make_llava(path: Path, *, strategy: str = "default", layer: int = -2, new_keys: bool = False,
               seed: int = 0) -> Path:
    """Save a random LlavaForConditionalGeneration, its tokenizer (with ``<image>``) and image processor."""
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, PreTrainedTokenizerFast)

    tok_dir = tiny_tokenizers.make(path.parent / f"{path.name}-tokenizer", "sentencepiece")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = CLIPVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                         vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                         projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the default init: varied continuations
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
                       ).save_pretrained(path)
    if new_keys:
        _new_layout(path)
    return path


def _new_layout(path: Path) -> None:
    """Rewrite the weights (saved as ``language_model.model.*``) with the layout of ``model.language_model.*``."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    renamed = {}
    for key, value in load_file(file).items():
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key == "language_model.lm_head.weight":
            key = "lm_head.weight"
        else:
            key = "model." + key
        renamed[key] = value
    save_file(renamed, file, metadata={"format": "pt"})


def png(seed: int, size: int = 40) -> bytes:
    """A random RGB PNG (encoded bytes), different per seed."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size + 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def reference_generate(path: Path, prompt: str, image: bytes | None, max_new_tokens: int) -> list[int]:
    """Greedy token ids from transformers' LlavaForConditionalGeneration (the placeholder expanded by the processor)."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(prompt)["input_ids"]
    inputs = {}
    if image is not None:  # what LlavaProcessor does: one <image> token per visual feature
        tokens = visual_tokens(model.config)
        ids = [t for i in ids for t in ([i] * tokens if i == model.config.image_token_index else [i])]
        pixels = CLIPImageProcessor.from_pretrained(path)(Image.open(io.BytesIO(image)), return_tensors="pt")
        inputs["pixel_values"] = pixels["pixel_values"]
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0].tolist()


def visual_tokens(config) -> int:
    """Image features per image: one per patch, plus the CLS feature under strategy "full"."""
    patches = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    return patches + (config.vision_feature_select_strategy == "full")
