"""What a served repository offers the OpenAI API: its generator and embedder models, tokenizers, adapters.

Read once at start-up from the repository's own ``config.pbtxt`` files (protobuf) and manifest, so it
works for every target and for hand-written repositories whose models follow the same tensor names: a
generator is a model taking ``text_input`` and a token budget (``max_tokens``, or the LLM-API model's
``sampling_param_max_tokens``; an ensemble first), an embedder one taking
``text_input`` and answering ``embedding``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..clients.inference import ModelInputs, is_text_generator
from ..clients.lora_requests import ServedAdapter, repository_adapters
from .schema import ModelCard
from .vllm_interface import with_virtual_inputs

LLAVA_TURN = "USER: {user} ASSISTANT:"  # LLaVA-1.5's conversation format, for tokenizers without a template


@dataclass
class TextModel:
    """A served model and the tokenizer its preprocessing uses."""

    inputs: ModelInputs
    tokenizer: Any = None
    add_special_tokens: bool = True
    parameters: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.inputs.name

    @property
    def vocab_size(self) -> int | None:
        """Token ids this model's tokenizer knows (its preprocessing's ``vocab_size`` without one)."""
        if self.tokenizer is not None and not hasattr(self.tokenizer, "max_length"):
            return len(self.tokenizer)
        return _int(self.parameters, "vocab_size")

    def count(self, text: str, *, special: bool | None = None) -> int:
        """Tokens of ``text`` as the served preprocessing counts them."""
        from ..in_triton import forge_text

        if hasattr(self.tokenizer, "max_length"):  # an encoder's own tokenizer model (truncates as it does)
            return int(self.tokenizer([text])["attention_mask"].sum()) if "attention_mask" in \
                self.tokenizer.outputs else int(self.tokenizer([text])["input_ids"].shape[1])
        add = self.add_special_tokens if special is None else special
        return len(forge_text.token_ids(text, self.tokenizer, add))

    def token_ids(self, text: str) -> list[int]:
        """``text`` as the served preprocessing tokenizes it."""
        from ..in_triton import forge_text

        return forge_text.token_ids(text, self.tokenizer, self.add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens kept (what an echoed token-id prompt shows)."""
        from ..in_triton import forge_text

        return forge_text.decode(self.tokenizer, ids, False)


@dataclass
class Catalog:
    """The model ids of a served repository and the models that answer them."""

    model_id: str
    created: int
    generator: TextModel | None = None
    stopper: ModelInputs | None = None  # the generator's step that takes TensorRT-LLM's ``stop`` request
    embedder: TextModel | None = None
    embedding_dim: int | None = None
    adapters: dict[str, ServedAdapter] = field(default_factory=dict)
    max_input_len: int | None = None
    max_seq_len: int | None = None
    image_placeholder: str | None = None
    skip_special_tokens: bool = True  # how the served postprocessing decodes (set when it was built)
    _shapes: Any = field(default=None, repr=False)

    def ids(self) -> list[str]:
        return [self.model_id, *sorted(self.adapters)]

    def shapes(self):
        """OpenAI's log-prob objects with the generator's token texts (``logprobs.Shapes``), made once."""
        if self._shapes is None:
            from ..in_triton import forge_text
            from .logprobs import Shapes

            self._shapes = Shapes(forge_text.TokenBytes(self.generator.tokenizer, skip_special_tokens=False))
        return self._shapes

    @property
    def max_model_len(self) -> int | None:
        """The longest sequence (prompt and answer) the served model takes, as vLLM's ``max_model_len``."""
        return self.max_seq_len or self.max_input_len


@dataclass
class _Config:
    """One model of the repository as its ``config.pbtxt`` says it."""

    inputs: ModelInputs
    platform: str  # "ensemble", "python", "tensorrtllm", ...
    directory: Path
    output_dims: dict[str, list[int]]

    @property
    def parameters(self) -> dict[str, str]:
        return self.inputs.parameters


def _configs(repo: Path) -> dict[str, _Config]:
    from google.protobuf import json_format

    from ..tritonconfig import read

    found = {}
    for config_file in sorted(repo.glob("*/config.pbtxt")):
        try:
            config = read(config_file.parent)
        except Exception:  # noqa: BLE001 - a model forge cannot parse is one the OpenAI API does not use
            continue
        as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True)
        as_dict.setdefault("name", config_file.parent.name)
        inputs = with_virtual_inputs(ModelInputs.from_config(as_dict))  # vLLM-backend models' sampling
        dims = {o["name"]: [int(d) for d in o.get("dims", [])] for o in as_dict.get("output", [])}
        found[inputs.name] = _Config(inputs, config.platform or config.backend, config_file.parent, dims)
    return found


def _prefer(names: list[str], configs: dict[str, _Config]) -> str | None:
    """Ensembles first, then the one named like tensorrtllm_backend's entry point."""
    def rank(name: str) -> tuple:
        return (configs[name].platform != "ensemble", not name.endswith("ensemble"), name != "ensemble", len(name),
                name)

    return min(names, key=rank) if names else None


def _tokenizer_of(model: str, configs: dict[str, _Config]) -> tuple[Any, bool, dict[str, str]]:
    """The tokenizer of the first step of ``model`` (or ``model`` itself) that names a ``tokenizer_dir``."""
    from ..in_triton import forge_text

    for name in [model, *configs[model].inputs.steps]:
        if name not in configs:
            continue
        params, directory = configs[name].parameters, configs[name].directory
        value = params.get("tokenizer_dir")
        if params.get("max_length") and (directory / "1" / params.get("tokenizer_file", "tokenizer.json")).is_file():
            from ..in_triton.encoder_models import tokenizer as encoder_tokenizer  # an encoder tower's tokenizer model

            return encoder_tokenizer.from_parameters(params, str(directory / "1")), True, params
        if not value or value.startswith("${"):
            continue
        path = forge_text.resolve_dir(value, str(directory), "1")
        remote = forge_text.parse_bool(params.get("trust_remote_code"), False)
        try:
            with contextlib.nullcontext() if remote else _transformers_without_torch():
                tokenizer = forge_text.load_tokenizer(path, trust_remote_code=remote)
        except Exception as exc:  # noqa: BLE001 - said once at start-up, the API still serves what it can
            raise UsageError(f"the OpenAI API cannot load the tokenizer of model {name!r} ({path}): {exc}") from None
        # the first encode may reset the truncation and padding that tokenizer.json sets; done here, it cannot
        # race an encode of another request on a worker thread ("Already borrowed")
        forge_text.token_ids("", tokenizer, False)
        return tokenizer, forge_text.parse_bool(params.get("add_special_tokens"), True), params
    return None, True, {}


@contextlib.contextmanager
def _transformers_without_torch():
    """Where neither transformers nor torch is imported yet (forge serve's own process): transformers is imported
    taking torch and the vision libraries (torchvision, scipy) as not installed, which it remembers. The API
    only tokenizes and renders chat templates, and transformers with torch imports ``torch._dynamo`` and
    torchvision on the way: about 650 MB and 3 s of a 2-core CPU. They stay importable for any other code of
    the process."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        yield
        return
    from ..in_triton.forge_glue import VISION_LIBRARIES

    hidden = [name for name in ("torch", *VISION_LIBRARIES) if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # reads as not installed, to import and to importlib.util.find_spec
    said = logging.getLogger("transformers")  # its "PyTorch was not found" advice is not for forge's users
    quiet = _Quiet()
    said.addFilter(quiet)
    try:
        yield
    finally:
        said.removeFilter(quiet)
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


def _int(params: dict[str, str], key: str) -> int | None:
    value = params.get(key, "")
    return int(value) if value.strip().isdigit() else None


def _bool(value: str) -> bool:
    from ..in_triton import forge_text

    return forge_text.parse_bool(value, True)


def load(repo: Path, served_name: str | None = None) -> Catalog:
    """The catalog of ``repo`` (a model repository being served)."""
    repo = Path(repo).resolve()
    configs = _configs(repo)
    catalog = Catalog(served_name or repo.name, int(repo.stat().st_mtime))

    generators = [n for n, c in configs.items() if is_text_generator(c.inputs)]
    name = _prefer(generators, configs)
    if name is not None:
        tokenizer, special, params = _tokenizer_of(name, configs)
        # an ensemble streams when one of its steps is decoupled (its own config cannot say so)
        steps = [configs[s] for s in configs[name].inputs.steps if s in configs]
        inputs = configs[name].inputs
        inputs = replace(inputs, decoupled=inputs.decoupled or any(s.inputs.decoupled for s in steps))
        catalog.generator = TextModel(inputs, tokenizer, special, params)
        catalog.stopper = next((s.inputs for s in steps if {"stop", "input_ids"} <= set(s.inputs.inputs)), None)
        catalog.max_input_len = _int(params, "max_input_len")
        limits = [_int(c.parameters, "max_seq_len") for n, c in configs.items()
                  if n == name or n in configs[name].inputs.steps]
        catalog.max_seq_len = next((v for v in limits if v), None)
        decoding = [configs[n].parameters for n in [name, *configs[name].inputs.steps] if n in configs]
        catalog.skip_special_tokens = next((_bool(p["skip_special_tokens"]) for p in decoding
                                            if "skip_special_tokens" in p), True)
        if params.get("image_token_id"):
            catalog.image_placeholder = params.get("image_placeholder") or "<image>"
        try:
            catalog.adapters = repository_adapters(repo)
        except UsageError:
            catalog.adapters = {}  # not a forge repository: no manifest, no adapters

    embedders = [n for n, c in configs.items() if "text_input" in c.inputs.inputs and "embedding" in c.inputs.outputs]
    name = _prefer(embedders, configs)
    if name is not None:
        tokenizer, special, params = _tokenizer_of(name, configs)
        catalog.embedder = TextModel(configs[name].inputs, tokenizer, special, params)
        dims = configs[name].output_dims.get("embedding") or []
        catalog.embedding_dim = dims[-1] if dims and dims[-1] > 0 else None
    if catalog.generator is None and catalog.embedder is None:
        raise UsageError(f"{repo} has no model the OpenAI API can serve (none takes text_input)",
                         hint="serve it with --no-openai")
    return catalog


def model_card(catalog: Catalog, model_id: str) -> ModelCard:
    """One entry of ``GET /v1/models``."""
    if model_id != catalog.model_id:  # an adapter: its base model is its parent
        return ModelCard(id=model_id, created=catalog.created, parent=catalog.model_id, root=catalog.model_id,
                         max_model_len=catalog.max_model_len)
    return ModelCard(id=model_id, created=catalog.created, max_model_len=catalog.max_model_len)

