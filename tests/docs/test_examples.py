"""The shell examples the docs mark as runnable still run: each is a ```bash block right after a
``<!-- runnable -->`` line in README.md or docs/**/*.md, run with bash (errexit, pipefail) in a scratch
folder with this environment's ``forge`` on PATH. Mark only examples that need no GPU, no model download
and a few seconds at most."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^```bash[^\n]*\n(.*?)^```", re.S | re.M)


def examples() -> list:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for match in re.finditer(re.escape(MARKER) + r"\s*\n", text):
            block = FENCE.match(text, match.end())
            rel = page.relative_to(ROOT)
            line = text.count("\n", 0, match.end()) + 1
            found.append(pytest.param(block.group(1) if block else None, id=f"{rel}:{line}"))
    return found


@pytest.mark.parametrize("script", examples())
def test_runnable_example(script: str | None, tmp_path: Path) -> None:
    assert script is not None, f"'{MARKER}' must come right before a ```bash block"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n--- script\n{script}\n--- stdout\n{done.stdout[-2000:]}" \
                                 f"\n--- stderr\n{done.stderr[-2000:]}"


def test_some_examples_are_marked() -> None:
    assert examples(), f"no '{MARKER}' example in README.md or docs/"
