"""Plain data passed between the driver and plugins: families, components, artifacts, edges."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

if TYPE_CHECKING:  # tritonclient.grpc takes 0.15 s to import; forge export never needs it
    from tritonclient.grpc import model_config_pb2 as mc


#: Kinds of ``-o`` values; the driver checks a value against its option's kind before any stage runs.
OPTION_KINDS = ("bool", "int", "float", "str", "path", "choice")


@dataclass(frozen=True)
class Option:
    """One ``-o key=value`` build option a family reads: its contract, shown by ``forge options``.

    This declaration is the only one: ``forge build`` makes its first-class flags from ``flag``
    (``forge.commands.build``), and the driver checks every value against ``kind``, ``choices`` and the
    bounds before any stage runs (:func:`forge.contract.check_value`), then hands it to ``parse``.
    ``targets`` names the targets that use it (empty: every target of the family); giving an
    option to a build whose target does not use it is an error, never a silent no-op.
    """

    name: str
    kind: str  # one of OPTION_KINDS
    help: str  # one line
    default: Any = None  # None: no default (the option is off or derived), shown as "-"
    targets: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()  # the allowed values of a "choice" option
    minimum: float | None = None  # the smallest allowed value of an "int" / "float" option
    exclusive_minimum: float | None = None  # values must be greater than this (a tolerance of 0 never passes)
    flag: str | None = None  # the first-class CLI flag that sets it too (e.g. "--instances")
    repeat: bool = False  # the flag may be given several times; its values arrive as a list
    #: the family's reading of a value as given, once its kind is checked (``--lora NAME=DIR`` → {name: dir});
    #: raises UsageError. None: the value is read as given
    parse: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        # A declaration mistake, not a user's: choices on another kind would never be checked, and a
        # value outside them would pass the build and be read as something else by whatever serves it.
        if self.kind not in OPTION_KINDS:
            raise ValueError(f"option {self.name!r}: kind {self.kind!r} is not one of {', '.join(OPTION_KINDS)}")
        if self.choices and self.kind != "choice":
            raise ValueError(f"option {self.name!r}: choices are checked only for kind 'choice', not {self.kind!r}")
        if (self.minimum is not None or self.exclusive_minimum is not None) and self.kind not in ("int", "float"):
            raise ValueError(f"option {self.name!r}: bounds are checked only for kinds 'int' and 'float'")
        if self.flag is not None and not self.flag.startswith("--"):
            raise ValueError(f"option {self.name!r}: flag {self.flag!r} does not start with '--'")
        if self.repeat and self.flag is None:
            raise ValueError(f"option {self.name!r}: only a flag can be repeated")

    def used_by(self, target: str) -> bool:
        """True when a build for ``target`` reads this option."""
        return not self.targets or target in self.targets


class DeferredOptions(Sequence):
    """A family's options, made by ``make`` when first read.

    The decoder families' options are folded from every tensorrtllm_backend release (``forge.llm.decoder_options``):
    ~20 ms (measured) that the commands which never read a family's options (``export``, ``serve``,
    ``infer``, ``plugins``) would otherwise pay at plugin registration.
    """

    def __init__(self, make: Callable[[], Sequence[Option]]):
        self._make = make
        self._options: tuple[Option, ...] | None = None

    def _all(self) -> tuple[Option, ...]:
        if self._options is None:
            self._options = tuple(self._make())
        return self._options

    def __getitem__(self, index):
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[Option]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self._all() == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"DeferredOptions({self._all()!r})"


@dataclass(frozen=True)
class Family:
    """A model family a plugin adds: which checkpoints it accepts and which components it builds.

    ``components`` maps a build spec to the components of the pipeline (one for a plain decoder or
    MiniLM, two for CLIP's vision and text towers, three for LLaVA); the driver runs every hook
    stage once per component.
    """

    name: str
    kind: str  # "decoder", "encoder", or a stage such as "retrieval"
    description: str
    architectures: tuple[str, ...]
    targets: tuple[str, ...]
    default_target: str
    components: Callable[["BuildSpec"], list["Component"]]  # noqa: F821 (spec.BuildSpec)
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    quants: tuple[str, ...] = ()
    #: the targets on which ``--tp`` / ``--pp`` > 1 mean something (empty: the family has no parallelism)
    parallel_targets: tuple[str, ...] = ()
    #: every ``-o`` option the family reads (first-class flags such as ``--instances`` included)
    options: Sequence[Option] = ()  # a tuple, or DeferredOptions where they are costly to make
    #: options that make the family join a build that does not name it (``--store`` adds retrieval);
    #: a joined family takes no weights, so dtype, quantization and parallelism are not its concern
    joins_on: tuple[str, ...] = ()
    #: the repository layouts of the backend releases the family builds (``forge.profiles.LAYOUTS``); without
    #: ``--backend-version`` it builds for the newest release of one of them. Empty: every layout (or none applies)
    layouts: tuple[str, ...] = ()
    plugin: str = ""  # filled in by the registry: the plugin that registered the family

    def option(self, name: str) -> Option | None:
        """The family's declaration of ``-o name`` (None when it does not read it)."""
        return next((o for o in self.options if o.name == name), None)

    def options_for(self, target: str) -> tuple[Option, ...]:
        """The options a build of this family for ``target`` reads."""
        return tuple(o for o in self.options if o.used_by(target))


@dataclass(frozen=True)
class Component:
    """One unit of a pipeline that goes through export → quantize → compile → emit_config."""

    name: str  # unique within a build, also the Triton model-name prefix source
    family: str
    role: str  # e.g. "llm", "vision", "text"
    source: Path  # the checkpoint directory (or file) this component is built from
    prefix: str = ""  # prepended to every Triton model name this component emits
    ensemble: str = "ensemble"  # name of the ensemble its edges belong to
    options: Mapping[str, Any] = field(default_factory=dict)

    def model_name(self, base: str) -> str:
        """The Triton model name for ``base`` (e.g. "preprocessing") in this component."""
        return f"{self.prefix}{base}"


@dataclass
class Artifact:
    """What a stage produced: a directory of files plus json-able metadata.

    ``commands`` are external command lines the stage ran (or would run) and go into the manifest.
    """

    kind: str
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    commands: list[list[str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "meta": self.meta, "commands": self.commands}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Artifact":
        return cls(data["kind"], Path(data["path"]), dict(data.get("meta", {})),
                   [list(c) for c in data.get("commands", [])])

    def moved(self, path: Path) -> "Artifact":
        return dataclasses.replace(self, path=path)


@dataclass
class TritonModel:
    """A Triton model to write into the repository: its config and the files of its directory.

    ``files`` maps a path relative to the model directory (``"1/model.py"``) to a source file or
    directory to copy, or to bytes/str content to write.
    """

    config: mc.ModelConfig
    files: dict[str, Path | bytes | str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class Port:
    """One end of an edge: a model's tensor, or (``model=None``) the ensemble's own interface."""

    model: str | None
    tensor: str

    def __str__(self) -> str:
        return f"{self.model or '<ensemble>'}.{self.tensor}"


@dataclass(frozen=True)
class Edge:
    """A tensor flowing from ``src`` to ``dst`` inside the ensemble named ``ensemble``."""

    src: Port
    dst: Port
    ensemble: str = "ensemble"

    @classmethod
    def feed(cls, tensor: str, model: str, model_tensor: str | None = None,
             ensemble: str = "ensemble") -> "Edge":
        """Ensemble input ``tensor`` feeds ``model.model_tensor``."""
        return cls(Port(None, tensor), Port(model, model_tensor or tensor), ensemble)

    @classmethod
    def link(cls, src_model: str, src_tensor: str, dst_model: str, dst_tensor: str,
             ensemble: str = "ensemble") -> "Edge":
        """``src_model.src_tensor`` feeds ``dst_model.dst_tensor``."""
        return cls(Port(src_model, src_tensor), Port(dst_model, dst_tensor), ensemble)

    @classmethod
    def result(cls, model: str, model_tensor: str, tensor: str | None = None,
               ensemble: str = "ensemble") -> "Edge":
        """``model.model_tensor`` becomes ensemble output ``tensor``."""
        return cls(Port(model, model_tensor), Port(None, tensor or model_tensor), ensemble)
