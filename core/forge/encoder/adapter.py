"""Declarative description of an encoder family and the interface of each of its towers.

A family adapter says which towers the family builds (CLIP: vision and text; MiniLM: text), which
Hugging Face architectures it accepts, how close an export must stay to torch, and how to open a
checkpoint. Opening a checkpoint gives an :class:`EncoderSource`, the only family-specific code:
it describes each tower's tensors without importing torch, writes the preprocessing assets
(tokenizer) and builds the torch module that computes the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from ..components import Option
from ..errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from ..context import BuildContext

TEXT = "text"
IMAGE = "image"
EMBEDDING = "embedding"  # the output tensor of every encoder and every encoder ensemble

#: Default parity tolerances per precision: max |Δ| of the embedding against torch float32, divided by
#: max(1, largest |value|) — see forge.encoder.encoder_parity.check.
DEFAULT_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "int8": 0.15}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a tower's interface; ``dims`` exclude the batch dimension, -1 is dynamic."""

    name: str
    dtype: str  # Triton data type without TYPE_: INT32, FP32
    dims: tuple[int, ...]
    axes: tuple[str, ...] = ()  # symbolic name of each dim (ONNX dynamic axis names), "" when fixed

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims), "axes": list(self.axes)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TensorSpec":
        return cls(data["name"], data["dtype"], tuple(data["dims"]), tuple(data.get("axes", ())))


@dataclass(frozen=True)
class TowerInterface:
    """What a tower computes and how its inputs are prepared; json-able and known without torch.

    ``preprocessing`` holds the settings of the python preprocessing model: for text towers
    ``max_length``, ``pad_id``, ``fixed_length`` (CLIP pads to its context length), ``lowercase``;
    for image towers the resize/crop/normalise recipe of the model's own processor.
    """

    role: str
    modality: str  # TEXT or IMAGE
    inputs: tuple[TensorSpec, ...]
    output: TensorSpec
    preprocessing: Mapping[str, Any] = field(default_factory=dict)
    notes: Mapping[str, Any] = field(default_factory=dict)  # facts for the manifest

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "modality": self.modality,
                "inputs": [t.to_json() for t in self.inputs], "output": self.output.to_json(),
                "preprocessing": dict(self.preprocessing), "notes": dict(self.notes)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TowerInterface":
        return cls(data["role"], data["modality"], tuple(TensorSpec.from_json(t) for t in data["inputs"]),
                   TensorSpec.from_json(data["output"]), dict(data.get("preprocessing", {})),
                   dict(data.get("notes", {})))


class EncoderSource(Protocol):
    """A family's reader of one checkpoint format (sentence-transformers, HF CLIPModel, open_clip)."""

    kind: str  # recorded in the manifest, e.g. "sentence-transformers"

    def interface(self, role: str) -> TowerInterface:
        """The tower's tensors and preprocessing settings (cheap: no torch)."""

    def write_assets(self, role: str, dest: Path) -> None:
        """Write the files the preprocessing model needs (``tokenizer.json`` for text towers)."""

    def load(self, role: str) -> Any:
        """A ``torch.nn.Module`` mapping the interface's inputs (int64 ids) to the embedding."""

    def reference_tokens(self, role: str, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` from the model's own tokenizer library (checks the served one)."""


@dataclass(frozen=True)
class Tower:
    """One pipeline of a family: a preprocessing model feeding an encoder."""

    role: str  # Component.role: "text", "vision"
    modality: str  # TEXT or IMAGE
    pipeline: str  # the ensemble's name when several families share a repository


@dataclass(frozen=True)
class EncoderAdapter:
    """Everything family-specific about an encoder family, as data."""

    family: str
    description: str
    architectures: tuple[str, ...]
    towers: tuple[Tower, ...]
    open_source: Callable[[Path, "BuildContext"], EncoderSource]  # checks the checkpoint, cheap
    tolerance: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TOLERANCE))
    #: ensemble name when the family is built alone and has one pipeline ("ensemble": default clients)
    solo_ensemble: str | None = None
    #: ``-o`` options only this family reads (the shared ones are ``forge.encoder.encoder_options.OPTIONS``)
    options: tuple[Option, ...] = ()

    def tower(self, role: str) -> Tower:
        for tower in self.towers:
            if tower.role == role:
                return tower
        known = ", ".join(t.role for t in self.towers)
        raise UsageError(f"family {self.family!r} has no tower {role!r}; its towers: {known}")

    def check_architecture(self, architecture: str, where: Path) -> None:
        """Refuse a checkpoint of another architecture, listing the supported ones."""
        if architecture not in self.architectures:
            raise UsageError(f"{where}: architecture {architecture or '(none)'!r} is not supported by family "
                             f"{self.family!r}; supported: {', '.join(self.architectures)}")
