"""Tiny random GPT-2 / Llama bases and PEFT LoRA adapters made with the real ``peft`` package."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
for folder in ("serve", "llama"):
    if str(_TESTS / folder) not in sys.path:
        sys.path.insert(0, str(_TESTS / folder))

from llama_models import make_llama  # noqa: E402
from serve_models import make_gpt2  # noqa: E402

__all__ = ["make_adapter", "make_gpt2", "make_llama", "peft_model", "greedy"]


def make_adapter(base: Path, out: Path, *, r: int, alpha: float, targets, seed: int, std: float = 0.3,
                 **config) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (PEFT would start B at zero).

    Values are rounded to float16 so the served float16 ``lora_weights`` hold exactly the adapter's numbers
    (alpha / r is a power of two in the tests, so folding the scale into B stays exact too).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    conv1d = model.config.model_type == "gpt2"
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False, fan_in_fan_out=conv1d, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_((std * torch.randn(p.shape, generator=gen)).half().float())
    peft.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path | None):
    """transformers (+ PEFT) float32 model, the reference the served answers are compared with."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def greedy(model, ids: list[int], new_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy continuation of ``ids`` (stops at ``eos``, which is left out, as TensorRT-LLM does)."""
    import torch

    ids = list(ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == eos:
                break
            out.append(token)
    return out
