"""``-o parity=true``: the exported rank files' logits (numpy reference) against transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from forge.errors import ForgeError

from .adapter import DecoderAdapter

#: Relative logit tolerance of an export, per dtype, as a multiple of the adapter's float32 tolerance.
PARITY_SCALE = {"float32": 1.0, "float16": 100.0, "bfloat16": 500.0}
PARITY_TOKENS = 16


def check_parity(adapter: DecoderAdapter, source: Path, checkpoint_dir: Path, dtype: str, ctx) -> dict[str, Any]:
    """``-o parity=true``: compare the rank files' logits (numpy reference) with transformers'.

    Loads the whole model twice (transformers and the reference), so it is meant for small models.
    """
    import torch
    import transformers

    from .reference import ReferenceModel, max_abs_diff

    config = json.loads((checkpoint_dir / "config.json").read_text())
    ids = [(7 * i + 3) % config["vocab_size"] for i in range(PARITY_TOKENS)]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                              trust_remote_code=ctx.spec.trust_remote_code)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    del model
    got = ReferenceModel(checkpoint_dir).logits(ids)
    scale = max(1.0, float(np.abs(expected).max()))
    relative = max_abs_diff(got, expected) / scale
    tolerance = ctx.option("parity_tolerance") or adapter.parity_tolerance * PARITY_SCALE[dtype]
    result = {"tokens": len(ids), "max_abs_diff": round(relative * scale, 6), "relative": relative,
              "tolerance": tolerance, "argmax_agreement": float((got.argmax(-1) == expected.argmax(-1)).mean())}
    ctx.note("parity", result)
    if relative > tolerance:
        raise ForgeError(f"exported checkpoint's logits differ from transformers by {relative:.3g} (relative to "
                         f"max |logit| {scale:.3g}), above the tolerance {tolerance:g}",
                         hint="this is a converter bug for this checkpoint; please report it with --debug output")
    return result
