"""The pieces under llava that need no server: placeholder expansion, the language-model split, base64 images."""

from __future__ import annotations

import base64
import json

import pytest

from tiny_llava import png


def test_placeholder_expands_into_prompt_table_ids():
    from forge.in_triton.forge_text import expand_image

    assert expand_image([1, 5, 9, 7], 9, "<image>", 100, 3) == [1, 5, 100, 101, 102, 7]
    assert expand_image([1, 5, 7], 9, "<image>", 100, 0) == [1, 5, 7]  # text-only
    with pytest.raises(ValueError, match="no image was sent"):
        expand_image([1, 9, 7], 9, "<image>", 100, 0)
    with pytest.raises(ValueError, match="exactly once"):
        expand_image([1, 9, 9], 9, "<image>", 100, 3)
    with pytest.raises(ValueError, match="exactly once"):
        expand_image([1, 7], 9, "<image>", 100, 3)


def test_language_model_part_is_a_plain_llama_checkpoint(tiny_llava):
    """Both key layouts give the same plain Llama tensors; transformers loads the part as LlamaForCausalLM."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    from forge import subcheckpoint
    from forge_llava.checkpoint import TOKENIZER_FILES, read

    facts = read(tiny_llava)
    part = subcheckpoint.extract(tiny_llava, facts.text_config, facts.language_model_name, what="test-lm",
                                 extra_files=TOKENIZER_FILES)
    assert subcheckpoint.extract(tiny_llava, facts.text_config, facts.language_model_name, what="test-lm",
                                 extra_files=TOKENIZER_FILES) == part  # cached: written once
    names = {n for f in part.glob("*.safetensors") for n in safe_open(str(f), "np").keys()}
    assert "lm_head.weight" in names and all(n.startswith(("model.", "lm_head.")) for n in names)
    assert not any("vision" in n or "projector" in n for n in names)
    assert json.loads((part / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    lm = AutoModelForCausalLM.from_pretrained(part, dtype=torch.float32)
    full = LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32)
    ids = torch.tensor([[1, 36, 230, 228, 10]])
    with torch.no_grad():
        assert torch.equal(lm(ids).logits, full(input_ids=ids).logits)


def test_images_arrive_raw_or_base64():
    from forge.in_triton.multimodal_encoders.encoders import from_base64

    image = png(3)
    assert from_base64(image) == image
    assert from_base64(base64.b64encode(image)) == image
    assert from_base64(b"not base64 and not an image!") == b"not base64 and not an image!"
