"""The vector store as the build and the CLI see it: URI checks, opening with one-line errors, collections.

Connections and searches are ``forge_store`` (shipped into the repository with the retriever);
this module adds what only forge's own commands do: refusing bad URIs, creating collections with
the right dimension, metric and index, and checking an existing collection against an encoder.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

from ..errors import ForgeError, UsageError
from ..in_triton.retriever import forge_store

METRIC = "COSINE"  # sentence and CLIP embeddings are compared by cosine (= inner product once normalised)
#: Below this many vectors exact search (FLAT) is fast enough and exact; above it HNSW.
HNSW_FROM = 20_000
HNSW_PARAMS = {"M": 16, "efConstruction": 200}
_COLLECTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")

# pymilvus logs every failed call with a traceback; forge reports the failure itself, in one line.
logging.getLogger("pymilvus").setLevel(logging.CRITICAL)


def normalize_uri(uri: str) -> str:
    """A Lite path made absolute, or a server URI checked; credentials in the URI are refused."""
    if forge_store.is_lite(uri):
        return str(Path(uri).expanduser().resolve())
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https", "tcp", "grpc") or not parts.hostname:
        raise UsageError(f"--store {uri!r} is neither a Milvus Lite path (ending in .db) nor a server URI "
                         "such as http://host:19530")
    if parts.username or parts.password or "token" in parts.query.lower():
        raise UsageError("--store must not carry credentials (they would land in shell history and the manifest)",
                         hint=f"put the token in the environment variable {forge_store.TOKEN_ENV}")
    return uri


def check_collection(name: str) -> str:
    if not _COLLECTION.match(name or ""):
        raise UsageError(f"invalid collection name {name!r}: letters, digits and '_', starting with a letter or '_'")
    return name


def check_outside(uri: str, repo: Path) -> None:
    """A Lite store inside the repository would be swapped away by the next build and read as a model."""
    if forge_store.is_lite(uri):
        try:
            Path(uri).resolve().relative_to(repo.resolve())
        except ValueError:
            return
        raise UsageError(f"--store {uri} is inside the repository {repo}; tritonserver would take it for a model "
                         "and the next build would replace it", hint="put the .db beside the repository")


@contextlib.contextmanager
def opened(uri: str) -> Iterator[object]:
    """A client of ``uri`` for the duration of a command (a Lite file is released afterwards)."""
    try:
        client = forge_store.connect(uri)
    except forge_store.StoreUnavailable as exc:
        raise ForgeError(str(exc)) from None
    try:
        yield client
    finally:
        forge_store.release(uri)


def failure(uri: str, exc: Exception) -> ForgeError:
    """A pymilvus error as one line naming the store."""
    return ForgeError(f"store {uri}: {getattr(exc, 'message', None) or exc}")


def check_dim(client, uri: str, collection: str, dim: int, what: str) -> None:
    """Refuse an encoder whose embeddings do not fit an existing collection."""
    existing = forge_store.collection_dim(client, collection)
    if existing is not None and existing != dim:
        raise UsageError(f"collection {collection!r} in {uri} holds {existing}-dimensional vectors but {what} "
                         f"produces {dim}", hint="choose another --collection, or rebuild with the encoder it was "
                         "indexed with")


def create_collection(client, collection: str, dim: int, rows: int) -> str:
    """Create ``collection`` (id, vector, document, content hash); returns the index type chosen."""
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field(forge_store.ID, DataType.VARCHAR, is_primary=True, max_length=forge_store.ID_MAX)
    schema.add_field(forge_store.VECTOR, DataType.FLOAT_VECTOR, dim=dim)
    schema.add_field(forge_store.DOCUMENT, DataType.VARCHAR, max_length=forge_store.DOCUMENT_MAX)
    schema.add_field(forge_store.CONTENT_HASH, DataType.VARCHAR, max_length=64)
    kind = index_type(rows)
    client.create_collection(collection, schema=schema, index_params=index_params(client, kind))
    return kind


def index_type(rows: int) -> str:
    return "HNSW" if rows >= HNSW_FROM else "FLAT"


def index_params(client, kind: str):
    params = client.prepare_index_params()
    params.add_index(forge_store.VECTOR, index_type=kind, metric_type=METRIC,
                     params=HNSW_PARAMS if kind == "HNSW" else {})
    return params


def current_index(client, collection: str) -> str:
    return forge_store.vector_index(client, collection).get("index_type", "")


def grow_index(client, collection: str, rows: int) -> str | None:
    """Switch a FLAT index to HNSW once the collection has grown past HNSW_FROM; returns the new type."""
    if index_type(rows) == "HNSW" and current_index(client, collection) == "FLAT":
        client.release_collection(collection)
        client.drop_index(collection, forge_store.VECTOR)
        client.create_index(collection, index_params(client, "HNSW"))
        return "HNSW"
    return None
