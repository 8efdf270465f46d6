"""The vocabulary of the release table: tensors, parameters, profiles and the edits a release row lists."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

# The four models of an inflight_batcher_llm repository (the ensemble is derived from routes).
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")

# What a release's repository looks like: the C++ backend serving a TensorRT engine behind preprocessing /
# postprocessing / ensemble, or (after TensorRT-LLM removed its engines) one python-backend ``tensorrt_llm``
# model driving the LLM API on PyTorch, configured by ``1/model.yaml``.
ENGINE, LLMAPI = "engine", "llmapi"
LAYOUTS = (ENGINE, LLMAPI)
YAML = "model.yaml"  # the ``model`` of a Parameter written into model.yaml instead of config.pbtxt

# Data types a build decides (engine logits dtype, model dtype) instead of the template.
LOGITS = "$logits"
PROMPT_TABLE = "$prompt_table"
ENCODER_FEATURES = "$encoder_features"


@dataclass(frozen=True)
class Tensor:
    """One input or output of a model, with its route inside the ensemble."""

    name: str
    dtype: str  # Triton type without TYPE_ ("INT32"), or one of LOGITS/PROMPT_TABLE/ENCODER_FEATURES
    dims: tuple[int, ...]
    output: bool = False
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    ragged: bool = False
    feed: str | None = None  # inputs: the ensemble input that feeds this tensor
    src: str | None = None  # inputs: "model.OUTPUT" that produces this tensor
    out: str | None = None  # outputs: the ensemble output this tensor becomes
    multimodal: bool = False  # image/video tensors; forge's text models leave them out
    feed_dims: tuple[int, ...] | None = None  # dims of the ensemble input when narrower than ``dims``


@dataclass(frozen=True)
class Parameter:
    """A ``parameters`` entry of a model config and the ``-o`` option that sets it."""

    key: str
    model: str = "tensorrt_llm"
    option: str = ""  # the -o name (tensorrtllm_backend's fill_template variable); "" = key
    default: str | None = None  # documented default, written when no -o is given; None: not written
    kind: str = "str"  # str, bool, int, float: how a -o value is checked
    choices: tuple[str, ...] = ()
    fixed: bool = False  # forge always writes ``default``; no -o can change it
    deprecated: tuple[str, ...] = ()  # values that still work but the backend deprecated
    help: str = ""

    @property
    def name(self) -> str:
        """The ``-o`` option name."""
        return self.option or self.key


@dataclass(frozen=True)
class Interface:
    inputs: tuple[Tensor, ...] = ()
    outputs: tuple[Tensor, ...] = ()

    def input(self, name: str) -> Tensor | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> Tensor | None:
        return next((t for t in self.outputs if t.name == name), None)


@dataclass(frozen=True)
class Profile:
    """Everything forge needs to emit repositories for one tensorrtllm_backend version."""

    version: str  # "v0.13.0"
    triton: str  # NGC release of the matching tritonserver trtllm container, "24.09"
    models: tuple[tuple[str, Interface], ...]
    parameters: tuple[Parameter, ...]
    dynamic_batching: frozenset[str]  # models whose template enables dynamic_batching
    aliases: tuple[str, ...] = ()  # other NGC releases that ship this backend version
    notes: str = ""
    layout: str = ENGINE

    @property
    def llmapi(self) -> bool:
        """Whether this release's repository is the LLM-API layout (model.yaml, no engine)."""
        return self.layout == LLMAPI

    def yaml_keys(self) -> tuple[Parameter, ...]:
        """The ``model.yaml`` keys of an LLM-API release (dotted paths for nested sections)."""
        return tuple(p for p in self.parameters if p.model == YAML)

    @property
    def container(self) -> str | None:
        """The NGC image ``forge serve --docker`` runs for this profile (None: no NGC release ships it yet)."""
        return f"nvcr.io/nvidia/tritonserver:{self.triton}-trtllm-python-py3" if self.triton else None

    def interface(self, model: str) -> Interface:
        """The tensors of ``model`` (one of MODELS); empty when the version lacks the model."""
        return dict(self.models).get(model, Interface())

    def has_model(self, model: str) -> bool:
        return model in dict(self.models)

    def params(self, model: str) -> tuple[Parameter, ...]:
        return tuple(p for p in self.parameters if p.model == model)

    def parameter(self, model: str, key: str) -> Parameter | None:
        return next((p for p in self.parameters if p.model == model and p.key == key), None)


# -- edits: how one release differs from the one before ----------------------------------------

@dataclass(frozen=True)
class Add:
    model: str
    tensor: Tensor


@dataclass(frozen=True)
class Drop:
    path: str  # "model.in.NAME" or "model.out.NAME"


@dataclass(frozen=True)
class Change:
    path: str
    fields: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Rename:
    path: str
    new: str
    feed: bool = True  # rename the ensemble tensor too when it had the same name


@dataclass(frozen=True)
class SetParam:
    parameter: Parameter


@dataclass(frozen=True)
class DropParam:
    model: str
    key: str


@dataclass(frozen=True)
class Batching:
    model: str
    enabled: bool


@dataclass(frozen=True)
class Release:
    """One row of the table: a backend version, its container, and what changed."""

    version: str
    triton: str
    changes: tuple[Any, ...] = ()
    aliases: tuple[str, ...] = ()
    notes: str = ""
    layout: str = ENGINE  # a row whose layout differs from the row before starts its tensors and parameters anew


# -- a small vocabulary to keep the rows readable ---------------------------------------------

def i(name: str, dtype: str, *dims: int, opt: bool = False, scalar: bool = False,
      ragged: bool = False, feed: str | bool | None = None, src: str | None = None,
      mm: bool = False, feed_dims: tuple[int, ...] | None = None) -> Tensor:
    """An input; ``scalar`` adds ``reshape: { shape: [ ] }``; ``feed=True`` feeds it by its own name."""
    return Tensor(name, dtype, tuple(dims), optional=opt, reshape=() if scalar else None,
                  ragged=ragged, feed=name if feed is True else feed, src=src, multimodal=mm,
                  feed_dims=feed_dims)


def o(name: str, dtype: str, *dims: int, out: str | bool | None = None, mm: bool = False) -> Tensor:
    """An output; ``out=True`` makes it the ensemble output of the same name."""
    return Tensor(name, dtype, tuple(dims), output=True, out=name if out is True else out,
                  multimodal=mm)


def add(model: str, *tensors: Tensor) -> tuple[Add, ...]:
    return tuple(Add(model, t) for t in tensors)


def drop(*paths: str) -> tuple[Drop, ...]:
    return tuple(Drop(p) for p in paths)


def change(*paths: str, **fields: Any) -> tuple[Change, ...]:
    if "dims" in fields:
        fields["dims"] = tuple(fields["dims"])
    if fields.pop("scalar", False):
        fields["reshape"] = ()
    return tuple(Change(p, tuple(sorted(fields.items()))) for p in paths)


def param(key: str, default: Any = None, *, model: str = "tensorrt_llm", **kw: Any) -> SetParam:
    if isinstance(default, bool):
        default = "true" if default else "false"
    return SetParam(Parameter(key, model=model, default=None if default is None else str(default), **kw))


def flag(key: str, default: bool | None, **kw: Any) -> SetParam:
    return param(key, default, kind="bool", **kw)


def number(key: str, default: Any = None, *, kind: str = "int", **kw: Any) -> SetParam:
    return param(key, default, kind=kind, **kw)


BATCHING = ("inflight_fused_batching", "inflight_batching", "V1")
SCHEDULER = ("guaranteed_no_evict", "max_utilization")
IMAGE_WORKER = "/opt/tritonserver/backends/tensorrtllm"


_NEWEST_FLAGS = (99, 0, 0)  # no --backend-version: the newest flag set


def parse_version(text: str | None) -> tuple[int, int, int]:
    """``"v0.13.0"`` → (0, 13, 0); None → the newest flag set."""
    if text is None:
        return _NEWEST_FLAGS
    match = re.fullmatch(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.-]?\w*)?", text.strip())
    if not match:
        raise UsageError(f"cannot read --backend-version {text!r}; write it like v0.13.0")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]

