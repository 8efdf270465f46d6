"""Milvus access shared by the ``retriever`` model and ``forge index`` / ``forge search``; imports nothing of forge.

Shipped beside the retriever's ``model.py``. A store URI is either a Milvus Lite data directory (a
path ending in ``.db``) or a Milvus server (``http://host:19530``). The token of a server comes from
the environment (``MILVUS_TOKEN``), never from a command line or a config file.

Milvus Lite lets one process at a time open a ``.db`` (it holds a ``LOCK`` file). To let
``forge index`` write while tritonserver's retriever answers searches, the process that opens the
file serves it on a loopback gRPC port and writes that port beside the file
(``NAME.db.endpoint.json``); a second process that finds the file locked connects to that port
instead. When the owner exits the file is free again and the next open takes it over.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from typing import Any

TOKEN_ENV = "MILVUS_TOKEN"
ID, VECTOR, DOCUMENT, CONTENT_HASH = "id", "vector", "document", "content_hash"
ID_MAX = 512
DOCUMENT_MAX = 65535
CONNECT_TIMEOUT_S = 5.0

_owned: dict[str, tuple[Any, Any, int]] = {}  # Lite path → (grpc server, engine, port) opened here
_lock = threading.Lock()


class StoreUnavailable(Exception):
    """The store cannot be reached or opened; the message names the URI."""


def is_lite(uri: str) -> bool:
    """True for a Milvus Lite data directory (``PATH.db``), False for a server URI."""
    return "://" not in uri and uri.rstrip("/").endswith(".db")


def endpoint_file(path: str) -> str:
    return os.path.abspath(path).rstrip("/") + ".endpoint.json"


def _client(uri: str, token: str | None = None):
    from pymilvus import MilvusClient
    from pymilvus.exceptions import MilvusException

    try:
        return MilvusClient(uri=uri, token=token or "", timeout=CONNECT_TIMEOUT_S)
    except MilvusException as exc:
        raise StoreUnavailable(f"cannot reach the Milvus store at {uri}: {getattr(exc, 'message', exc)}") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _shared_port(path: str) -> int | None:
    try:
        with open(endpoint_file(path)) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return int(data["port"]) if _pid_alive(int(data.get("pid", 0))) else None


def _open_lite(path: str):
    path = os.path.abspath(path).rstrip("/")
    with _lock:
        if path in _owned:
            return _client(f"http://127.0.0.1:{_owned[path][2]}")
        try:
            from milvus_lite.adapter.grpc.server import start_server_in_thread
            from milvus_lite.exceptions import DataDirLockedError
        except ImportError:
            raise StoreUnavailable(f"cannot open the Milvus Lite store {path}: milvus-lite is not installed "
                                   "(pip install 'forge-triton[retrieval]')") from None
        if not os.path.isdir(os.path.dirname(path)):
            raise StoreUnavailable(f"cannot open the Milvus Lite store {path}: "
                                   f"{os.path.dirname(path)} is not a directory")
        try:
            server, engine, port = start_server_in_thread(data_dir=path, host="127.0.0.1", port=0)
        except DataDirLockedError:
            port = _shared_port(path)
            if port is None:
                raise StoreUnavailable(
                    f"the Milvus Lite store {path} is open in another process that shares no endpoint "
                    "(a program other than forge); stop it, or serve the store with "
                    f"'milvus-lite server --data-dir {path}' and use --store http://127.0.0.1:19530") from None
            return _client(f"http://127.0.0.1:{port}")
        except OSError as exc:
            raise StoreUnavailable(f"cannot open the Milvus Lite store {path}: {exc}") from None
        _owned[path] = (server, engine, port)
        tmp = f"{endpoint_file(path)}.{os.getpid()}"
        with open(tmp, "w") as handle:
            json.dump({"pid": os.getpid(), "port": port}, handle)
        os.replace(tmp, endpoint_file(path))
    return _client(f"http://127.0.0.1:{port}")


def connect(uri: str):
    """A ``MilvusClient`` for ``uri`` (the token from ``MILVUS_TOKEN``); StoreUnavailable names the URI."""
    if is_lite(uri):
        return _open_lite(uri)
    return _client(uri, os.environ.get(TOKEN_ENV))


def release(uri: str) -> None:
    """Close a Milvus Lite store this process opened, so another process can take it over."""
    if not is_lite(uri):
        return
    path = os.path.abspath(uri).rstrip("/")
    with _lock:
        owned = _owned.pop(path, None)
    if owned is None:
        return
    server, engine, _ = owned
    try:
        with open(endpoint_file(path)) as handle:
            if json.load(handle).get("pid") == os.getpid():
                os.unlink(endpoint_file(path))
    except (OSError, ValueError):
        pass
    server.stop(grace=1).wait()
    engine.close()


@atexit.register
def _release_all() -> None:
    for path in list(_owned):
        release(path)


def settle(uri: str, collection: str, timeout: float = 600.0) -> bool:
    """Wait until Milvus Lite has compacted and indexed what was flushed; False when it cannot tell.

    A Lite flush returns before its background worker has merged segments and built their HNSW
    graphs, and ``describe_index`` reports "Finished" all along; until the worker is done,
    searches scan the unindexed segments one vector at a time (~100× slower at 100k vectors).
    Only the process that opened the file holds the engine; a server (or a store opened by another
    process) settles on its own.
    """
    if not is_lite(uri):
        return False
    owned = _owned.get(os.path.abspath(uri).rstrip("/"))
    drain = None
    if owned is not None:
        try:
            drain = getattr(owned[1].get_collection(collection), "_wait_for_bg", None)
        except Exception:  # noqa: BLE001 - a missing collection has nothing to settle
            return False
    if drain is None:
        return False
    drain(timeout=timeout)
    return True


def collection_dim(client, collection: str) -> int | None:
    """The vector dimension of ``collection`` (None when it does not exist)."""
    if not client.has_collection(collection):
        return None
    for field in client.describe_collection(collection)["fields"]:
        if field["name"] == VECTOR:
            return int(field["params"]["dim"])
    return None


def search_params(client, collection: str, k: int) -> dict:
    """Search parameters for the collection's index: HNSW gets ``ef`` ≥ k (recall), FLAT nothing."""
    index = client.describe_index(collection, VECTOR) or {}
    params = {"metric_type": index.get("metric_type", "COSINE")}
    if index.get("index_type", "").startswith("HNSW"):
        params["params"] = {"ef": max(64, 2 * k)}
    return params


def search(client, collection: str, vectors, k: int, params: dict) -> list[list[tuple[str, float, str]]]:
    """Top-``k`` (id, score, document json) per query vector, best first."""
    hits = client.search(collection, data=[list(map(float, v)) for v in vectors], limit=k,
                         output_fields=[DOCUMENT], search_params=params, anns_field=VECTOR)
    return [[(str(h["id"]), float(h["distance"]), h["entity"].get(DOCUMENT, "null")) for h in row] for row in hits]
