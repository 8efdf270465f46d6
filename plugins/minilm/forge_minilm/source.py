"""Reading a sentence-transformers model directory (``modules.json``) for the minilm family."""

from __future__ import annotations

import shutil
from pathlib import Path

from forge.context import BuildContext
from forge.encoder.adapter import EMBEDDING, TEXT, EncoderAdapter, TensorSpec, TowerInterface
from forge.errors import UsageError
from forge.hf import inspect_checkpoint, read_json

#: sentence-transformers pooling modes forge can put in the graph, in sentence-transformers' order.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")
_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model")


class SentenceTransformerSource:
    """A sentence-transformers directory (Transformer → Pooling → Normalize) or a bare HF encoder."""

    kind = "sentence-transformers"

    def __init__(self, path: Path, ctx: BuildContext, adapter: EncoderAdapter):
        self.path, self.ctx = path, ctx
        modules = self._modules(path)
        transformer = next(m for m in modules if m[0] == "Transformer")
        self.model_dir = path / transformer[1]
        self.checkpoint = inspect_checkpoint(self.model_dir, allow_pickle=ctx.spec.allow_pickle,
                                             trust_remote_code=ctx.spec.trust_remote_code)
        adapter.check_architecture(self.checkpoint.architecture, self.model_dir / "config.json")
        pooling = [m for m in modules if m[0] == "Pooling"]
        self.modes = self._pooling_modes(path / pooling[0][1] if pooling and pooling[0][1] is not None else None)
        self.normalize = any(m[0] == "Normalize" for m in modules)
        self.has_modules_json = (path / "modules.json").is_file()
        st_config = self.model_dir / "sentence_bert_config.json"
        settings = read_json(st_config, "sentence-transformers settings") if st_config.is_file() else {}
        self.lowercase = bool(settings.get("do_lower_case", False))
        self.model_max_length = self._max_length(settings)
        self.max_length = min(self.model_max_length, ctx.spec.limits.max_input_len)

    @staticmethod
    def _modules(path: Path) -> list[tuple[str, str]]:
        """(module class name, sub-directory) of every module; a bare HF encoder is Transformer + mean Pooling."""
        if not (path / "modules.json").is_file():
            return [("Transformer", ""), ("Pooling", None)]  # sentence-transformers' default for plain models
        entries = read_json_list(path / "modules.json")
        modules = []
        for entry in entries:
            kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
            if kind not in ("Transformer", "Pooling", "Normalize"):
                raise UsageError(f"{path}/modules.json uses module {entry.get('type')!r}, which forge cannot put "
                                 "in an ONNX graph; supported: Transformer, Pooling, Normalize")
            modules.append((kind, str(entry.get("path", ""))))
        if [m[0] for m in modules].count("Transformer") != 1:
            raise UsageError(f"{path}/modules.json must list exactly one Transformer module")
        return modules

    @staticmethod
    def _pooling_modes(pooling_dir: Path | None) -> tuple[str, ...]:
        if pooling_dir is None or not (pooling_dir / "config.json").is_file():
            return ("mean",)
        config = read_json(pooling_dir / "config.json", "the pooling config")
        if "pooling_mode" in config:  # newer sentence-transformers: a name or a list of names
            named = config["pooling_mode"]
            modes = [named] if isinstance(named, str) else list(named)
        else:
            modes = [mode for key, mode in _POOLING_KEYS.items() if config.get(key)]
        unsupported = [m for m in modes if m not in POOLING_MODES]
        if unsupported or not modes:
            raise UsageError(f"{pooling_dir}/config.json asks for pooling {', '.join(unsupported) or '(none)'}; "
                             f"forge supports {', '.join(POOLING_MODES)}")
        return tuple(m for m in POOLING_MODES if m in modes)

    def _max_length(self, settings: dict) -> int:
        if isinstance(settings.get("max_seq_length"), int):
            return settings["max_seq_length"]
        tok_config = self.model_dir / "tokenizer_config.json"
        if tok_config.is_file():
            value = read_json(tok_config, "the tokenizer config").get("model_max_length")
            if isinstance(value, int) and value < 100_000:
                return value
        positions = self.checkpoint.config.get("max_position_embeddings", 512)
        # RoBERTa-style models reserve padding_idx + 1 positions
        return positions - 2 if self.checkpoint.model_type in ("roberta", "xlm-roberta") else positions

    def interface(self, role: str) -> TowerInterface:
        hidden = self.checkpoint.config.get("hidden_size") or self.checkpoint.config.get("dim")
        if not isinstance(hidden, int):
            raise UsageError(f"{self.model_dir}/config.json has no hidden_size")
        pad_id = self.checkpoint.config.get("pad_token_id")
        ids = (TensorSpec("input_ids", "INT32", (-1,), ("sequence",)),
               TensorSpec("attention_mask", "INT32", (-1,), ("sequence",)))
        return TowerInterface(
            role=role, modality=TEXT, inputs=ids, output=TensorSpec(EMBEDDING, "FP32", (hidden * len(self.modes),)),
            preprocessing={"max_length": self.max_length, "pad_id": pad_id if isinstance(pad_id, int) else 0,
                           "lowercase": self.lowercase},
            notes={"architecture": self.checkpoint.architecture, "pooling": list(self.modes),
                   "normalize": self.normalize, "max_seq_length": self.max_length,
                   "modules_json": self.has_modules_json})

    def write_assets(self, role: str, dest: Path) -> None:
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).is_file():
                shutil.copy2(self.model_dir / name, dest / name)
        if not (dest / "tokenizer.json").is_file():  # slow-tokenizer files only: convert them once
            self._hf_tokenizer().backend_tokenizer.save(str(dest / "tokenizer.json"))

    def _hf_tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.model_dir), trust_remote_code=self.ctx.spec.trust_remote_code)
        except Exception as exc:  # transformers raises OSError/ValueError/KeyError for broken tokenizers
            raise UsageError(f"{self.model_dir}: cannot load the tokenizer: {exc}") from None

    def reference_tokens(self, role: str, texts: list[str]) -> list[list[int]]:
        tokenizer = self._hf_tokenizer()
        if self.lowercase:
            texts = [t.lower() for t in texts]
        return tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]

    def load(self, role: str):
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # forge shows its own progress

        from ._pooling import SentenceEmbedding

        model = AutoModel.from_pretrained(
            str(self.model_dir), use_safetensors=self.checkpoint.weight_format == "safetensors",
            trust_remote_code=self.ctx.spec.trust_remote_code, attn_implementation="eager")
        return SentenceEmbedding(model, self.modes, self.normalize)


def read_json_list(path: Path) -> list[dict]:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise UsageError(f"{path} must be a json list of module objects")
    return data
