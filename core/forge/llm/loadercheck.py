"""TensorRT-LLM's own checkpoint loader and ``trtllm-build`` argument parser as checks of forge's output.

``FORGE_TRTLLM_CHECK`` names a trtllm-check directory: ``check_ckpt.py`` (runs, per rank, what
``trtllm-build`` runs before building: ``PretrainedConfig`` → ``Model.from_checkpoint``, strict about
tensors the library would ignore), ``trtllm_build_args.py`` (that release's own argparse) and the
TensorRT-LLM source tarball ``trtllm-src-VERSION.tar.gz``. When it is set, the stage that writes the
final checkpoint loads it with that source and the compile stage parses its command line with it; the
manifest records the result and the TensorRT-LLM version (``notes.trtllm_check``), or "not checked".

Accepted by that loader means names, shapes, dtypes and layer placement are what ``trtllm-build``
reads, not that an engine was built. A source speaks for one release (TensorRT-LLM 0.16 ↔
tensorrtllm_backend v0.16): a rejection fails the build for that ``--backend-version`` and is a
recorded warning for the others, whose loaders differ (pipeline split, rope scaling, flags).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from forge.errors import ForgeError, UsageError

from ..profiles import parse_version

# subprocess, tarfile and tempfile are imported where they are used: every export imports this
# module, and most never run the checker (start-up is part of the export's time)

ENV = "FORGE_TRTLLM_CHECK"
TARBALL = re.compile(r"trtllm-src-(\d+\.\d+\.\d+[\w.]*)\.tar\.gz$")
NOT_CHECKED = f"not checked (set {ENV} to a trtllm-check directory to load it with TensorRT-LLM's own code)"
TIMEOUT_S = 600


@dataclass(frozen=True)
class Checker:
    """A trtllm-check directory and the TensorRT-LLM source it runs."""

    root: Path
    version: str  # TensorRT-LLM version of the source, e.g. 0.16.0.dev2024121000
    src: Path  # the extracted source (holds tensorrt_llm/)

    @property
    def source(self) -> str:
        return f"TensorRT-LLM {self.version} source"

    def speaks_for(self, backend_version: str | None) -> bool:
        """True when ``--backend-version`` is the release this source belongs to."""
        if backend_version is None:
            return False  # the newest profile is newer than any source shipped for checking
        return parse_version(backend_version)[:2] == parse_version(self.version)[:2]

    def run(self, script: str, args: Sequence[str]) -> tuple[int, str]:
        """(exit status, last output line) of one of the checker's scripts."""
        import subprocess

        argv = [sys.executable, str(self.root / script), *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"})
        except subprocess.TimeoutExpired:
            return 2, f"{script} did not finish in {TIMEOUT_S} s"
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        return done.returncode, lines[-1] if lines else f"{script} printed nothing"


    def check_checkpoints(self, dirs: Sequence[Path], strict: bool = True) -> dict[Path, tuple[bool, str]]:
        """(accepted, line) per checkpoint directory, from one checker process (the import is paid once)."""
        import subprocess

        argv = [sys.executable, str(self.root / "check_ckpt.py"), "--src", str(self.src), *map(str, dirs)]
        done = subprocess.run([*argv, *([] if strict else ["--lenient"])], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        lines = done.stdout.splitlines()
        found: dict[Path, tuple[bool, str]] = {}
        for d in dirs:
            prefix = f"{d}: " if len(dirs) > 1 else ""
            line = next((ln[len(prefix):] for ln in lines if ln.startswith(prefix) and ":" in ln[len(prefix):]),
                        None)
            found[Path(d)] = (bool(line and line.startswith("OK:")), line or done.stdout + done.stderr[-2000:])
        return found


def _extract(tarball: Path, dest: Path) -> None:
    """Unpack ``tarball`` into ``dest`` (through a temporary sibling); a failure is one UsageError."""
    import tarfile
    import tempfile

    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest.parent))
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(tmp, dest)  # another build may have won the race: its copy is the same
    except (OSError, tarfile.TarError) as exc:
        if isinstance(exc, tarfile.TarError) or not (dest / "tensorrt_llm").is_dir():
            raise UsageError(f"cannot unpack {tarball}: {' '.join(str(exc).split())}") from None  # tarfile's span lines
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def at(root: Path, cache: Path) -> Checker:
    """The checker in trtllm-check directory ``root``, its source unpacked once under ``cache``."""
    tarballs = sorted(p for p in root.glob("trtllm-src-*.tar.gz") if TARBALL.search(p.name)) if root.is_dir() else []
    if not (root / "check_ckpt.py").is_file() or not tarballs:
        raise UsageError(f"{root} is not a trtllm-check directory (it needs check_ckpt.py and "
                         "trtllm-src-VERSION.tar.gz)", hint=f"point {ENV} at one, or unset it")
    version = TARBALL.search(tarballs[-1].name).group(1)
    src = cache / version
    if not (src / "tensorrt_llm" / "models" / "modeling_utils.py").is_file():
        _extract(tarballs[-1], src)
    return Checker(root, version, src)


def find() -> Checker | None:
    """The checker ``FORGE_TRTLLM_CHECK`` names (source unpacked into forge's cache), or None."""
    from forge.cache import cache_dir

    value = os.environ.get(ENV)
    return at(Path(value).expanduser(), cache_dir() / "trtllm-src") if value else None


def _verdict(ctx, checker: Checker, what: str, rc: int, line: str) -> dict[str, Any]:
    """The manifest entry of one check; a rejection fails the build where the source speaks for the release."""
    if rc == 2:
        ctx.log(f"warning: {checker.source} could not check the {what}: {line}")
        return {"result": f"not checked: the checker could not run ({line})", "by": checker.source}
    verdict = {"result": "accepted" if rc == 0 else "rejected", "by": checker.source, "output": line}
    if rc:
        message = f"{checker.source} rejects the {what}: {line}"
        if checker.speaks_for(ctx.spec.backend_version):
            raise ForgeError(message, hint="please report it with the manifest; --backend-version of another "
                                           "release is not checked by this source")
        ctx.log(f"warning: {message} (it speaks for TensorRT-LLM {checker.version}, not --backend-version "
                f"{ctx.spec.backend_version or 'newest'})")
    return verdict


def check_checkpoint(ctx, checkpoint_dir: Path) -> None:
    """Load a written checkpoint with TensorRT-LLM's own loader (strict) and note the result."""
    notes = dict(ctx.record.notes.get("trtllm_check") or {})
    checker = None if ctx.dry_run else find()
    if checker is None:
        notes["checkpoint"] = {"result": "not checked (dry run)" if ctx.dry_run else NOT_CHECKED}
    else:
        rc, line = checker.run("check_ckpt.py", ["--src", str(checker.src), str(checkpoint_dir)])
        notes["checkpoint"] = {**_verdict(ctx, checker, "checkpoint", rc, line), "mode": "strict"}
        if rc == 0:
            ctx.log(f"checkpoint accepted by {checker.source}'s loader (strict)")
    ctx.note("trtllm_check", notes)


def check_build_command(ctx, argv: Sequence[str]) -> None:
    """Parse a ``trtllm-build`` command with the argparse of the release the checker's source belongs to."""
    notes = dict(ctx.record.notes.get("trtllm_check") or {})
    checker = find()
    if checker is None:
        notes["build_command"] = {"result": NOT_CHECKED}
    elif not checker.speaks_for(ctx.spec.backend_version):
        notes["build_command"] = {"result": f"not checked: {checker.source} speaks for backend "
                                            f"v{'.'.join(checker.version.split('.')[:2])}.x, not "
                                            f"--backend-version {ctx.spec.backend_version or 'newest'}"}
    else:
        rc, line = checker.run("trtllm_build_args.py", ["--src", str(checker.src), "--", *map(str, argv)])
        notes["build_command"] = _verdict(ctx, checker, "trtllm-build command", rc, line)
    ctx.note("trtllm_check", notes)
