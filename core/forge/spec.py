"""The build spec: everything a build depends on, validated before any work starts."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import UsageError

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def check_name(value: str, what: str) -> str:
    """Reject names that could escape the repository (path separators, ``..``, empty)."""
    if not value or not _NAME.match(value) or value in (".", "..") or ".." in value:
        raise UsageError(f"invalid {what} {value!r}: use letters, digits, '_', '-' and '.' only "
                         "(no path separators)")
    return value


@dataclass
class Limits:
    """Engine/runtime size limits shared by compile and emit_config."""

    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int | None = None
    max_beam_width: int = 1
    given: tuple[str, ...] = ()  # the limits the user set (the others are these defaults)


@dataclass
class BuildSpec:
    """Inputs of one ``forge build`` (or ``forge export``) run."""

    families: list[str]
    model: Path
    out: Path
    tp: int = 1
    pp: int = 1
    dtype: str = "float16"
    dtype_given: bool = True  # False: --dtype was left at its default, so a family may pick a better one
    quant: tuple[str, ...] = ()
    target: str | None = None  # None: each family's default target
    backend_version: str | None = None  # None: the newest known profile
    limits: Limits = field(default_factory=Limits)
    options: dict[str, Any] = field(default_factory=dict)  # family options: ``-o key=value`` and their flags
    name_prefix: str = ""
    dry_run: bool = False
    allow_pickle: bool = False
    trust_remote_code: bool = False
    models: dict[str, Path] = field(default_factory=dict)  # per-family source for multi-family builds

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def source_for(self, family: str) -> Path:
        """The checkpoint a family's components read (``--model FAMILY=DIR`` overrides ``--model``)."""
        return self.models.get(family, self.model)

    def validate(self) -> "BuildSpec":
        """Check values that do not depend on the family; raise UsageError on the first bad one.

        Targets, dtypes, quantization, parallelism and options (``-o`` keys and the flags that set
        them) are the families' contract, checked by :mod:`forge.contract` against their declarations.
        """
        for label, value in (("--tp", self.tp), ("--pp", self.pp)):
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{label} must be a positive integer, got {value!r}")
        lim = self.limits
        for label in ("max_batch_size", "max_input_len", "max_seq_len", "max_beam_width"):
            if getattr(lim, label) < 1:
                raise UsageError(f"--{label.replace('_', '-')} must be ≥ 1")
        if lim.max_input_len >= lim.max_seq_len:
            raise UsageError("--max-input-len must be smaller than --max-seq-len")
        if self.name_prefix:
            check_name(self.name_prefix, "--name-prefix")
        if self.out.exists() and not self.out.is_dir():
            raise UsageError(f"--out {self.out} is a regular file, not a directory")
        return self

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["model"] = str(self.model)
        data["out"] = str(self.out)
        data["models"] = {k: str(v) for k, v in self.models.items()}
        data["quant"] = list(self.quant)
        return data
