"""Reading LLaVA-1.5 checkpoints: what is accepted, what is refused, and how the parts are named.

Accepted: Hugging Face ``LlavaForConditionalGeneration`` with a CLIP vision tower, the 2-layer GELU
projector and a Llama language model, in either key layout transformers has written:
``language_model.model.*`` / ``vision_tower.*`` / ``multi_modal_projector.*`` (before 4.52) and
``model.language_model.*`` / ``model.vision_tower.*`` / ``model.multi_modal_projector.*`` + ``lm_head.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from forge.errors import UsageError
from forge.hf import inspect_checkpoint, safetensors_header

ARCHITECTURES = ("LlavaForConditionalGeneration",)
STRATEGIES = ("default", "full")  # default: drop the CLS feature; full: keep it
LANGUAGE_MODELS = {"llama": "LlamaForCausalLM"}  # text_config.model_type → the architecture its plugin accepts
VISION_MODELS = ("clip_vision_model",)
PROJECTOR_ACTS = ("gelu",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "generation_config.json", "chat_template.jinja", "chat_template.json")

# The two key layouts: (language-model prefix, lm_head name, vision prefix, projector prefix).
LAYOUTS = {
    "language_model.model.*": ("language_model.model.", "language_model.lm_head.", "vision_tower.",
                               "multi_modal_projector."),
    "model.language_model.*": ("model.language_model.", "lm_head.", "model.vision_tower.",
                               "model.multi_modal_projector."),
}


@dataclass(frozen=True)
class LlavaFacts:
    """What the build needs to know about one LLaVA checkpoint (json-able, no torch)."""

    path: Path
    layout: str  # a key of LAYOUTS
    image_token_id: int
    vision_feature_layer: int
    strategy: str
    image_size: int
    patch_size: int
    vision_hidden: int
    text_hidden: int
    vocab_size: int
    text_config: Mapping[str, Any]

    @property
    def visual_tokens(self) -> int:
        """Prompt-table rows per image: one per patch, plus the CLS feature under strategy "full"."""
        return (self.image_size // self.patch_size) ** 2 + (self.strategy == "full")

    def language_model_name(self, name: str) -> str | None:
        """The plain Llama name of a checkpoint tensor (None: not a language-model tensor)."""
        body, head, _, _ = LAYOUTS[self.layout]
        if name.startswith(body):
            return "model." + name[len(body):]
        if name.startswith(head):
            return "lm_head." + name[len(head):]
        return None

    def vision_name(self, name: str) -> str | None:
        """The name of a vision-tower / projector tensor without the layout's prefix (None: another part)."""
        _, _, vision, projector = LAYOUTS[self.layout]
        if name.startswith(vision):
            return "vision_tower." + name[len(vision):]
        if name.startswith(projector):
            return "multi_modal_projector." + name[len(projector):]
        return None


def _text_config(config: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """The language model's complete config (transformers fills in the defaults a saved config omits)."""
    from transformers import AutoConfig

    text = dict(config.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in LANGUAGE_MODELS:
        raise UsageError(f"{where}: the language model is {model_type!r}; forge's llava family builds "
                         f"{', '.join(LANGUAGE_MODELS)} language models")
    full = AutoConfig.for_model(**text).to_dict()
    full["architectures"] = [LANGUAGE_MODELS[model_type]]
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        full.pop(key, None)
    if "dtype" in text or "torch_dtype" in text:
        full["torch_dtype"] = text.get("dtype") or text.get("torch_dtype")
    return full


def read(path: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> LlavaFacts:
    """Check a LLaVA checkpoint and return its facts; anything this family cannot build is one clear line."""
    checkpoint = inspect_checkpoint(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    where = path / "config.json"
    config = checkpoint.config
    if checkpoint.architecture not in ARCHITECTURES:
        raise UsageError(f"{where}: architecture {checkpoint.architecture or '(none)'!r} is not supported by family "
                         f"'llava'; supported: {', '.join(ARCHITECTURES)} (LLaVA-1.5: CLIP vision tower, 2-layer "
                         "GELU projector, Llama); LLaVA-NeXT, video and other vision towers are not")
    if checkpoint.weight_format != "safetensors":
        raise UsageError(f"{path}: the llava family reads safetensors weights only",
                         hint="convert the checkpoint to safetensors")
    vision = config.get("vision_config") or {}
    if vision.get("model_type", "clip_vision_model") not in VISION_MODELS:
        raise UsageError(f"{where}: vision tower {vision.get('model_type')!r} is not supported; forge's llava "
                         "family builds CLIP vision towers (clip_vision_model)")
    act = config.get("projector_hidden_act", "gelu")
    if act not in PROJECTOR_ACTS:
        raise UsageError(f"{where}: projector_hidden_act {act!r} is not supported (LLaVA-1.5 uses gelu)")
    layer = config.get("vision_feature_layer", -2)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise UsageError(f"{where}: vision_feature_layer {layer!r} is not supported (one layer index, "
                         "e.g. -2; lists of layers are not)")
    layers = int(vision.get("num_hidden_layers", 24))
    if not -(layers + 1) <= layer <= layers:
        raise UsageError(f"{where}: vision_feature_layer {layer} is outside the tower's {layers} layers")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in STRATEGIES:
        raise UsageError(f"{where}: vision_feature_select_strategy {strategy!r} is not supported; "
                         f"supported: {', '.join(STRATEGIES)}")
    token = config.get("image_token_index", config.get("image_token_id"))
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise UsageError(f"{where}: no usable image_token_index (got {token!r})")
    image_size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
    if image_size % patch:
        raise UsageError(f"{where}: image_size {image_size} is not a multiple of patch_size {patch}")
    text = _text_config(config, where)
    if token >= int(text["vocab_size"]):
        raise UsageError(f"{where}: image_token_index {token} is outside the language model's vocabulary "
                         f"({text['vocab_size']} tokens)")
    names = [k for f in checkpoint.weight_files for k in safetensors_header(f) if k != "__metadata__"]
    layout = next((name for name, (body, *_) in LAYOUTS.items() if any(n.startswith(body) for n in names)), None)
    if layout is None:
        raise UsageError(f"{path}: no language-model tensors in either key layout "
                         f"({' or '.join(LAYOUTS)}); is this a LlavaForConditionalGeneration checkpoint?")
    facts = LlavaFacts(path=path, layout=layout, image_token_id=token, vision_feature_layer=layer,
                       strategy=strategy, image_size=image_size, patch_size=patch,
                       vision_hidden=int(vision.get("hidden_size", 1024)), text_hidden=int(text["hidden_size"]),
                       vocab_size=int(text["vocab_size"]), text_config=text)
    if not any(facts.vision_name(n) for n in names):
        raise UsageError(f"{path}: no vision-tower or projector tensors in the {layout} layout")
    return facts
