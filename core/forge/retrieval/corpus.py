"""Reading a corpus for ``forge index``: texts from .txt / .jsonl, images from a folder.

Every document gets a stable id (its own ``id`` field, the image's path inside the folder, or a
hash of the text) and a content hash, so a second run skips what the store already holds and
an interrupted run resumes without duplicates. Everything is read and checked before anything is
written: a bad line or an unreadable image stops the run with one line naming it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..in_triton.retriever import forge_store

TEXT, IMAGE = "text", "image"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


@dataclass(frozen=True)
class Document:
    """One entry of the corpus: what is embedded (text or image bytes) and what is stored."""

    id: str
    modality: str  # TEXT or IMAGE
    payload: str | bytes  # the text, or the encoded image
    document: str  # the JSON object stored and returned by searches
    content_hash: str


def _hash(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _document(doc_id: str, modality: str, payload: str | bytes, body: dict[str, Any], where: str) -> Document:
    if not doc_id or len(doc_id.encode()) > forge_store.ID_MAX:
        raise UsageError(f"{where}: id must be 1 to {forge_store.ID_MAX} bytes, got {doc_id!r:.60}")
    document = json.dumps(body, ensure_ascii=False, sort_keys=True)
    if len(document.encode()) > forge_store.DOCUMENT_MAX:
        raise UsageError(f"{where}: document {doc_id!r} is {len(document.encode())} bytes as JSON; the store keeps "
                         f"at most {forge_store.DOCUMENT_MAX}", hint="split it into smaller documents")
    raw = payload.encode() if isinstance(payload, str) else payload
    return Document(doc_id, modality, payload, document, _hash(raw, document.encode()))


def _texts(path: Path) -> list[tuple[str, Document]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(f"{path}:{n}", _document("t" + _hash(line.strip().encode())[:24], TEXT, line.strip(),
                                      {"text": line.strip()}, f"{path}:{n}"))
            for n, line in enumerate(lines, 1) if line.strip()]


def _jsonl(path: Path) -> list[tuple[str, Document]]:
    result = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{where}: not a JSON object ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise UsageError(f"{where}: each line needs a non-empty \"text\" string "
                             "(and optionally \"id\" and \"metadata\")")
        metadata = row.get("metadata", {})
        if not isinstance(metadata, dict):
            raise UsageError(f"{where}: \"metadata\" must be a JSON object")
        extra = {k: v for k, v in row.items() if k not in ("id", "text", "metadata")}
        body = {"text": row["text"], "metadata": {**extra, **metadata}}
        doc_id = str(row["id"]) if row.get("id") is not None else "t" + _hash(row["text"].encode())[:24]
        result.append((where, _document(doc_id, TEXT, row["text"], body, where)))
    return result


def _images(folder: Path) -> list[tuple[str, Document]]:
    from PIL import Image, UnidentifiedImageError

    result = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES):
        try:
            data = path.read_bytes()
            with Image.open(path) as image:
                image.verify()
        except (OSError, UnidentifiedImageError, SyntaxError) as exc:
            raise UsageError(f"{path}: unreadable image ({type(exc).__name__}: {exc})",
                             hint="fix or remove it; nothing was indexed") from None
        rel = path.relative_to(folder).as_posix()
        result.append((str(path), _document(rel, IMAGE, data, {"image": str(path.resolve())}, str(path))))
    return result


def read(path: Path) -> list[Document]:
    """The documents of ``path`` (a .txt or .jsonl file, or a folder of images), duplicates checked."""
    if not path.exists():
        raise UsageError(f"corpus {path} does not exist")
    if path.is_dir():
        entries = _images(path)
    elif path.suffix.lower() == ".jsonl":
        entries = _jsonl(path)
    elif path.suffix.lower() == ".txt":
        entries = _texts(path)
    else:
        raise UsageError(f"corpus {path}: expected a .txt or .jsonl file or a folder of images "
                         f"({', '.join(IMAGE_SUFFIXES)})")
    if not entries:
        raise UsageError(f"corpus {path} holds no documents")
    seen: dict[str, tuple[str, Document]] = {}
    for where, doc in entries:
        first = seen.get(doc.id)
        if first is None:
            seen[doc.id] = (where, doc)
        elif first[1].content_hash != doc.content_hash:
            raise UsageError(f"{where}: duplicate id {doc.id!r} (first at {first[0]}) with different content",
                             hint="give every document its own id")
    return [doc for _, doc in seen.values()]
