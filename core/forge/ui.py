"""Terminal output: progress lines on stderr, data on stdout (``--json``)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


class Progress:
    """Timestamped progress lines on stderr (rich when stderr is a terminal)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.started = time.perf_counter()
        self._console = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console

            self._console = Console(stderr=True)

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.started
        if self._console is not None:
            self._console.print(f"[dim]{elapsed:7.1f}s[/dim] {message}", highlight=False)
        else:
            print(f"{elapsed:7.1f}s {message}", file=sys.stderr, flush=True)


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
