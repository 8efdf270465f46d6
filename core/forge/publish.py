"""Writing a model repository atomically: staging directory, lock, rename into place."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Iterator

from .cache import cache_dir, sha256
from .components import TritonModel
from .errors import UsageError

MANIFEST = "forge-manifest.json"
_STAGING = ".forge-staging-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> None:
    """Remove staging/old directories left by builds that were killed."""
    if not out.parent.is_dir():
        return
    for entry in out.parent.glob(f".{out.name}{_STAGING}*"):
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def locked(out: Path, lock_root: Path) -> Iterator[None]:
    """Hold an exclusive lock for writing ``out``; a second build fails instead of waiting.

    A ``flock`` on a file under ``lock_root`` (what filelock does on Linux, without its import time).
    """
    lock_root.mkdir(parents=True, exist_ok=True)
    key = sha256(str(out.resolve()).encode()).hexdigest()[:24]
    fd = os.open(lock_root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another forge build is writing {out}", hint="wait for it to finish") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def staging_dir(out: Path) -> Path:
    staging = out.parent / f".{out.name}{_STAGING}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def place(src: Path, dst: Path) -> None:
    """Copy a file or tree; files from the stage cache are hard-linked (engines can be GBs).

    Only cache files are linked: linking a user's checkpoint or forge's own sources would let an
    edit to one silently change the other.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    link = _under(src, cache_dir())
    copy = _link_or_copy if link else shutil.copy2
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=copy, dirs_exist_ok=True)
    else:
        copy(src, dst)


def _under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_model(model: TritonModel, repo: Path) -> None:
    """Write one model directory: config.pbtxt (round-tripped) and its files."""
    model_dir = repo / model.name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)  # Triton needs a version dir, ensembles too
    for rel, content in model.files.items():
        target = model_dir / rel
        if isinstance(content, Path):
            place(content, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content)
    from . import tritonconfig  # protobuf: not needed to export a checkpoint

    tritonconfig.write(model.config, model_dir)


def is_forge_repo(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def swap_into_place(staging: Path, out: Path) -> None:
    """Replace ``out`` by ``staging`` with renames, so ``out`` is never half-written."""
    if out.exists():
        old = out.parent / f".{out.name}{_STAGING}old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, out)
