"""Reading CLIP checkpoints: Hugging Face ``CLIPModel`` directories and open_clip models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from forge.context import BuildContext
from forge.encoder.adapter import EMBEDDING, IMAGE, TEXT, EncoderAdapter, TensorSpec, TowerInterface
from forge.encoder.hfimage import OPENAI_MEAN, OPENAI_STD, clip_image_recipe, pair as _pair
from forge.errors import ForgeError, UsageError
from forge.hf import inspect_checkpoint, read_json, safetensors_header

from .tokenizer import EOS, clip_tokenizer, open_clip_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")


def open_source(path: Path, ctx: BuildContext, adapter: EncoderAdapter):
    """The reader for ``path``: open_clip (config + weights, or weights + -o model_name) or HF CLIPModel."""
    if path.is_file() or (path / "open_clip_config.json").is_file():
        return OpenClipSource(path, ctx)
    return HFClipSource(path, ctx, adapter)


def _normalize(ctx: BuildContext) -> bool:
    value = ctx.option("normalize", False)
    if not isinstance(value, bool):
        raise UsageError(f"-o normalize={value!r}: expected true or false")
    return value


def _text_interface(role: str, context_length: int, pad_id: int, clean: str, notes: dict) -> TowerInterface:
    ids = TensorSpec("input_ids", "INT32", (context_length,), ("",))
    return TowerInterface(role=role, modality=TEXT, inputs=(ids,), output=TensorSpec(EMBEDDING, "FP32", (notes["dim"],)),
                          preprocessing={"max_length": context_length, "pad_id": pad_id, "fixed_length": True,
                                         "clean": clean},
                          notes=notes)


def _vision_interface(role: str, recipe: dict, notes: dict) -> TowerInterface:
    height, width = recipe["crop"] if recipe.get("crop") else recipe["size"]
    if (height, width) != tuple(notes["image_size"]):
        raise UsageError(f"the image processor produces {height}x{width} images but the vision tower takes "
                         f"{notes['image_size'][0]}x{notes['image_size'][1]}")
    pixels = TensorSpec("pixel_values", "FP32", (3, height, width), ("", "", ""))
    return TowerInterface(role=role, modality=IMAGE, inputs=(pixels,),
                          output=TensorSpec(EMBEDDING, "FP32", (notes["dim"],)), preprocessing=recipe, notes=notes)


class HFClipSource:
    """A Hugging Face ``CLIPModel`` directory with its tokenizer and image processor files."""

    kind = "transformers CLIPModel"

    def __init__(self, path: Path, ctx: BuildContext, adapter: EncoderAdapter):
        self.path, self.ctx = path, ctx
        self.checkpoint = inspect_checkpoint(path, allow_pickle=ctx.spec.allow_pickle,
                                             trust_remote_code=ctx.spec.trust_remote_code)
        adapter.check_architecture(self.checkpoint.architecture, path / "config.json")
        config = self.checkpoint.config
        self.vision_config = config.get("vision_config") or {}
        self.text_config = config.get("text_config") or {}
        self.dim = int(config.get("projection_dim", 512))
        self.normalize = _normalize(ctx)

    def interface(self, role: str) -> TowerInterface:
        notes = {"architecture": self.checkpoint.architecture, "dim": self.dim, "normalize": self.normalize}
        if role == "vision":
            size = int(self.vision_config.get("image_size", 224))
            return _vision_interface(role, self._image_recipe(size), {**notes, "image_size": [size, size]})
        length = int(self.text_config.get("max_position_embeddings", 77))
        return _text_interface(role, length, self._pad_id(), "none", {**notes, "context_length": length})

    def _image_recipe(self, image_size: int) -> dict[str, Any]:
        """CLIPImageProcessor's settings from preprocessor_config.json (its defaults when absent)."""
        return clip_image_recipe(self.path, image_size)

    def _pad_id(self) -> int:
        """The id the model's processor pads texts with (irrelevant to CLIP's causal text tower)."""
        special = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (self.path / name).is_file():
                special.update({k: v for k, v in read_json(self.path / name).items() if k == "pad_token"})
        token = special.get("pad_token", EOS)
        token = token.get("content", EOS) if isinstance(token, dict) else str(token)
        if (self.path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            found = Tokenizer.from_file(str(self.path / "tokenizer.json")).token_to_id(token)
            return found if found is not None else 0
        if (self.path / "vocab.json").is_file():
            return int(read_json(self.path / "vocab.json").get(token, 0))
        return 0

    def write_assets(self, role: str, dest: Path) -> None:
        if role != "text":
            return
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copy2(self.path / name, dest / name)
        if not (dest / "tokenizer.json").is_file():
            self._tokenizer().backend_tokenizer.save(str(dest / "tokenizer.json"))

    def _tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except Exception as exc:  # transformers raises many types for broken or missing tokenizer files
            raise UsageError(f"{self.path}: cannot load the CLIP tokenizer: {exc}") from None

    def reference_tokens(self, role: str, texts: list[str]) -> list[list[int]]:
        length = int(self.text_config.get("max_position_embeddings", 77))
        return self._tokenizer()(texts, truncation=True, max_length=length)["input_ids"]

    def load(self, role: str):
        from transformers import CLIPModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # forge shows its own progress

        from .towers import HFTextTower, HFVisionTower

        model = CLIPModel.from_pretrained(str(self.path), attn_implementation="eager",
                                          use_safetensors=self.checkpoint.weight_format == "safetensors")
        return (HFVisionTower if role == "vision" else HFTextTower)(model, self.normalize)


class OpenClipSource:
    """An open_clip model: ``open_clip_config.json`` + weights, or a weights file + ``-o model_name``."""

    kind = "open_clip"

    def __init__(self, path: Path, ctx: BuildContext):
        self.path, self.ctx = path, ctx
        if path.is_file():
            name = ctx.option("model_name")
            if not name:
                raise UsageError(f"--model {path} is a weights file: name its open_clip config with -o model_name=NAME "
                                 "(e.g. ViT-B-32), or pass a directory with open_clip_config.json")
            config_file = open_clip_dir() / "model_configs" / f"{name}.json"
            if not config_file.is_file():
                import difflib

                known = sorted(p.stem for p in config_file.parent.glob("*.json"))
                close = difflib.get_close_matches(str(name), known, n=6, cutoff=0.4) or known[:6]
                raise UsageError(f"open_clip has no model config {name!r}; closest: {', '.join(close)} "
                                 f"({len(known)} configs in {config_file.parent})")
            self.model_name, self.weights = str(name), path
            self.model_cfg, preprocess = read_json(config_file, "the open_clip model config"), {}
        else:
            data = read_json(path / "open_clip_config.json", "the open_clip config")
            if "model_cfg" not in data:
                raise UsageError(f"{path}/open_clip_config.json has no model_cfg")
            self.model_name = f"local-dir:{path.resolve()}"
            self.model_cfg, preprocess = data["model_cfg"], data.get("preprocess_cfg") or {}
            found = [path / n for n in OPEN_CLIP_WEIGHTS if (path / n).is_file()]
            if not found:
                raise UsageError(f"{path} has no open_clip weights ({' or '.join(OPEN_CLIP_WEIGHTS)})")
            self.weights = found[0]
        if self.weights.suffix == ".safetensors":
            safetensors_header(self.weights)
        elif not ctx.spec.allow_pickle:
            raise UsageError(f"{self.weights} is a pickle file; loading pickle can run arbitrary code",
                             hint="convert it to safetensors, or pass --allow-pickle")
        self.text_cfg, self.vision_cfg = self.model_cfg.get("text_cfg", {}), self.model_cfg.get("vision_cfg", {})
        if self.text_cfg.get("hf_tokenizer_name") or self.text_cfg.get("hf_model_name"):
            raise UsageError("open_clip models with Hugging Face text towers/tokenizers are not supported; "
                             "forge supports CLIP's own BPE tokenizer")
        if (self.text_cfg.get("tokenizer_kwargs") or {}).get("clean", "lower") != "lower":
            raise UsageError("open_clip tokenizer_kwargs other than clean=lower are not supported")
        self.preprocess = {"size": self.vision_cfg.get("image_size", 224), "mean": OPENAI_MEAN, "std": OPENAI_STD,
                           "interpolation": "bicubic", "resize_mode": "shortest", **preprocess}
        self.dim = int(self.model_cfg["embed_dim"])
        self.normalize = _normalize(ctx)

    def interface(self, role: str) -> TowerInterface:
        notes = {"model": self.model_name, "weights": self.weights.name, "dim": self.dim, "normalize": self.normalize}
        if role == "vision":
            size = _pair(self.vision_cfg.get("image_size", 224), "image_size")
            return _vision_interface(role, self._image_recipe(), {**notes, "image_size": list(size)})
        length = int(self.text_cfg.get("context_length", 77))
        return _text_interface(role, length, int(self.text_cfg.get("pad_id", 0)), "open_clip",
                               {**notes, "context_length": length})

    def _image_recipe(self) -> dict[str, Any]:
        """open_clip's eval transform (Resize + CenterCrop, or squash) as preprocessing settings."""
        p = self.preprocess
        height, width = _pair(p["size"], "preprocess size")
        if p["interpolation"] not in ("bicubic", "bilinear"):
            raise UsageError(f"open_clip interpolation {p['interpolation']!r} is not supported")
        common = {"crop_rounding": "round", "resample": p["interpolation"], "rgb": "convert", "rgb_step": "last",
                  "rescale": 1 / 255, "mean": list(p["mean"]), "std": list(p["std"]), "processor": "open_clip"}
        if p["resize_mode"] == "squash":
            return {"resize_mode": "exact", "size": [height, width], "crop": None, **common}
        if p["resize_mode"] != "shortest" or height != width:
            raise UsageError(f"open_clip resize_mode {p['resize_mode']!r} with size {height}x{width} is not "
                             "supported (shortest with a square size, or squash)")
        return {"resize_mode": "shortest_edge", "size": [height], "crop": [height, width], **common}

    def write_assets(self, role: str, dest: Path) -> None:
        if role == "text":
            clip_tokenizer(int(self.text_cfg.get("context_length", 77))).backend_tokenizer.save(str(dest / "tokenizer.json"))

    def reference_tokens(self, role: str, texts: list[str]) -> list[list[int]]:
        from open_clip.tokenizer import SimpleTokenizer

        length = int(self.text_cfg.get("context_length", 77))
        tokenizer = SimpleTokenizer(context_length=length)
        rows = tokenizer(texts).tolist()
        return [row[: row.index(tokenizer.eot_token_id) + 1] for row in rows]

    def load(self, role: str):
        import open_clip

        from .towers import OpenClipTower

        model = open_clip.create_model(self.model_name, pretrained=None, load_weights=False)
        try:
            open_clip.load_checkpoint(model, str(self.weights), strict=True, weights_only=True)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise UsageError(f"{self.weights} does not fit open_clip model {self.model_name}: "
                             f"{str(exc).splitlines()[0][:300]}") from None
        served = {k: self.preprocess[k] for k in ("mean", "std", "interpolation", "resize_mode")}
        actual = {k: model.visual.preprocess_cfg.get(k) for k in served}
        if json.dumps(served, default=list) != json.dumps({k: actual[k] for k in served}, default=list):
            raise ForgeError(f"open_clip's preprocessing {actual} differs from the recipe forge derived {served}")
        return OpenClipTower(model, role, self.normalize)
