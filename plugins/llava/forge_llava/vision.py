"""LLaVA's vision component for the shared encoder machinery: CLIP tower + feature selection + projector.

The torch module computes what transformers' ``get_image_features`` computes: the hidden states of
``vision_feature_layer`` (the tower's layers past it are dropped, they never reach the projector),
the CLS feature dropped under strategy "default", then the projector. Its output, one row per
visual token in the language model's hidden size, is the prompt table the decoder reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge.encoder.adapter import IMAGE, TensorSpec, TowerInterface
from forge.encoder.hfimage import clip_image_recipe

from .checkpoint import LlavaFacts

FEATURES = "image_features"  # the ONNX graph's output: [batch, visual tokens, text hidden size]


class LlavaVisionSource:
    """An :class:`~forge.encoder.adapter.EncoderSource` over a LLaVA checkpoint's vision part."""

    kind = "transformers LlavaForConditionalGeneration (vision tower + projector)"

    def __init__(self, facts: LlavaFacts):
        self.facts = facts

    def interface(self, role: str) -> TowerInterface:
        f = self.facts
        recipe = clip_image_recipe(f.path, f.image_size)
        pixels = TensorSpec("pixel_values", "FP32", (3, f.image_size, f.image_size), ("", "", ""))
        notes = {"visual_tokens": f.visual_tokens, "vision_feature_layer": f.vision_feature_layer,
                 "vision_feature_select_strategy": f.strategy, "image_size": [f.image_size, f.image_size],
                 "patch_size": f.patch_size, "hidden_size": f.text_hidden, "key_layout": f.layout}
        return TowerInterface(role=role, modality=IMAGE, inputs=(pixels,),
                              output=TensorSpec(FEATURES, "FP32", (f.visual_tokens, f.text_hidden), ("", "")),
                              preprocessing=recipe, notes=notes)

    def write_assets(self, role: str, dest: Path) -> None:
        """Image towers need no assets: the recipe travels as model parameters."""

    def reference_tokens(self, role: str, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError("the vision component has no tokenizer")

    def load(self, role: str) -> Any:
        """The torch module ``pixel_values → image_features`` with the checkpoint's weights."""
        return load_module(self.facts)


def load_parts(facts: LlavaFacts):
    """The checkpoint's vision tower (all layers) and projector, float32, as transformers builds them."""
    from safetensors import safe_open
    from transformers import AutoModel, LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    config = LlavaConfig.from_pretrained(str(facts.path))
    tower = AutoModel.from_config(config.vision_config, attn_implementation="eager")
    projector = LlavaMultiModalProjector(config)
    state: dict[str, dict[str, Any]] = {"vision_tower.": {}, "multi_modal_projector.": {}}
    for file in sorted(facts.path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as reader:
            for name in reader.keys():
                part = facts.vision_name(name)
                if part is not None:
                    prefix = next(p for p in state if part.startswith(p))
                    state[prefix][part[len(prefix):]] = reader.get_tensor(name).float()
    missing = [f"{p}{k}" for p, module in (("vision_tower.", tower), ("multi_modal_projector.", projector))
               for k in module.load_state_dict(state[p], strict=False).missing_keys]
    if missing:
        from forge.errors import UsageError

        raise UsageError(f"{facts.path}: the checkpoint lacks vision tensors, e.g. {missing[0]}")
    return tower.float().eval(), projector.float().eval()


def load_module(facts: LlavaFacts):
    """forge's module ``pixel_values → image_features`` (the tower cut after ``vision_feature_layer``)."""
    import torch
    from transformers import LlavaConfig

    layers = LlavaConfig.from_pretrained(str(facts.path)).vision_config.num_hidden_layers
    keep = facts.vision_feature_layer if facts.vision_feature_layer >= 0 else layers + 1 + facts.vision_feature_layer
    tower, projector = load_parts(facts)
    encoder = getattr(tower, "vision_model", tower).encoder  # transformers < 5 nests the transformer
    encoder.layers = encoder.layers[:keep]  # layers past vision_feature_layer do not reach the projector

    class VisionFeatures(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower, self.projector = tower, projector

        def forward(self, pixel_values):
            hidden = self.tower(pixel_values, output_hidden_states=True).hidden_states[keep]
            if facts.strategy == "default":
                hidden = hidden[:, 1:]
            return self.projector(hidden)

    return VisionFeatures().eval()
