"""What a stage hook receives besides its component: the spec, a work directory, and recorders."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import toolchain
from .spec import BuildSpec


@dataclass
class StageRecord:
    """What one stage of one component did; becomes part of the manifest."""

    stage: str
    key: str
    cached: bool = False
    seconds: float = 0.0
    commands: list[list[str]] = field(default_factory=list)
    executed: bool = True  # False when commands were only planned (dry run)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildContext:
    """Passed to every stage hook. Plugins write only below ``workdir``."""

    spec: BuildSpec
    target: str  # the resolved target of the component being built
    workdir: Path
    record: StageRecord
    log: Callable[[str], None] = lambda message: None

    @property
    def dry_run(self) -> bool:
        return self.spec.dry_run

    def option(self, key: str, default: Any = None) -> Any:
        """A family option given with ``-o key=value`` (or its default)."""
        return self.spec.options.get(key, default)

    def note(self, key: str, value: Any) -> None:
        """Record a json-able fact (parity numbers, recipe, opset) in the manifest."""
        self.record.notes[key] = value

    def run_tool(self, argv: list[str], *, purpose: str, cwd: Path | None = None) -> None:
        """Record an external command line and run it (only record it under ``--dry-run``)."""
        argv = [str(a) for a in argv]
        self.record.commands.append(argv)
        if self.dry_run:
            self.record.executed = False
            self.log(f"would run: {shlex.join(argv)}")
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        toolchain.run(argv, purpose=purpose, cwd=cwd, log=self.workdir / f"{Path(argv[0]).name}.log")
