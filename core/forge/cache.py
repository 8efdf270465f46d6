"""Stage cache: outputs keyed by a fingerprint of everything that produced them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .components import Artifact

try:  # CPython's own sha256 (hashlib's digests): hashlib's import loads OpenSSL, ~5-10 ms of every command (measured)
    from _sha2 import sha256  # Python 3.12+
except ImportError:
    try:
        from _sha256 import sha256  # Python 3.11
    except ImportError:
        from hashlib import sha256

CACHE_ENV = "FORGE_CACHE_DIR"
_HASH_WHOLE_BELOW = 1 << 20  # small files are hashed; large ones are identified by size+mtime


def cache_dir() -> Path:
    """``$FORGE_CACHE_DIR`` or the user cache directory."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("forge"))


def fingerprint(*parts: Any) -> str:
    """sha256 of the json form of ``parts`` (keys sorted)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return sha256(blob).hexdigest()


def source_fingerprint(path: Path) -> str:
    """Fingerprint a checkpoint file or directory without reading multi-GB weights."""
    entries = []
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        st = file.stat()
        rel = file.name if file == path else str(file.relative_to(path))
        if st.st_size < _HASH_WHOLE_BELOW:
            entries.append((rel, sha256(file.read_bytes()).hexdigest()))
        else:
            entries.append((rel, st.st_size, st.st_mtime_ns))
    return fingerprint(entries)


class StageCache:
    """A directory of finished stage outputs: ``<root>/stages/<key>/{artifact.json,data/}``."""

    def __init__(self, root: Path | None = None):
        self.root = (root or cache_dir()) / "stages"

    def get(self, key: str) -> Artifact | None:
        entry = self.root / key / "artifact.json"
        if not entry.is_file():
            return None
        try:
            data = json.loads(entry.read_text())
        except (OSError, ValueError):
            return None
        artifact = Artifact.from_json(data)
        artifact.path = self.root / key / "data" / data["relpath"] if data.get("relpath") else self.root / key / "data"
        return artifact if artifact.path.exists() else None

    def is_passthrough(self, key: str) -> bool:
        """True when the stage ran before and left its input unchanged (the hook returned None)."""
        return (self.root / key / "passthrough").is_file()

    def mark_passthrough(self, key: str) -> None:
        (self.root / key).mkdir(parents=True, exist_ok=True)
        (self.root / key / "passthrough").write_text("")

    def workdir(self, key: str) -> Path:
        """A fresh private directory for a stage to write into."""
        work = self.root.parent / "work" / f"{key[:16]}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        return work

    def put(self, key: str, artifact: Artifact, workdir: Path) -> Artifact:
        """Move ``workdir`` into the cache atomically and return the artifact rebased onto it."""
        final = self.root / key
        try:
            rel = artifact.path.resolve().relative_to(workdir.resolve())
        except ValueError:
            return artifact  # the plugin returned something outside its workdir: not cacheable
        data = artifact.to_json()
        data["relpath"] = "" if str(rel) == "." else str(rel)
        (workdir / "artifact.json.tmp").write_text(json.dumps(data, indent=1))
        staging = self.root / f".{key}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        os.rename(workdir, staging / "data")
        os.rename(staging / "data" / "artifact.json.tmp", staging / "artifact.json")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
        return self.get(key) or artifact
