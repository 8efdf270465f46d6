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
import time
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


def _client(uri: str, token: str | None = None, dedicated: bool = False):
    from pymilvus import MilvusClient
    from pymilvus.exceptions import MilvusException

    try:
        return MilvusClient(uri=uri, token=token or "", timeout=CONNECT_TIMEOUT_S, dedicated=dedicated)
    except MilvusException as exc:
        refused = _refused_credentials(exc)
        if refused:
            given = f"the token in {TOKEN_ENV}" if token else f"a connection without a token ({TOKEN_ENV} is not set)"
            raise StoreUnavailable(f"the Milvus store at {uri} refused {given}: {refused}") from None
        raise StoreUnavailable(f"cannot reach the Milvus store at {uri}: {getattr(exc, 'message', exc)}") from None


def _refused_credentials(exc: BaseException) -> str | None:
    """The server's words when it refused the credentials; pymilvus reports that as "cannot connect"."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        code = getattr(cause, "code", None)
        if callable(code) and getattr(code(), "name", "") == "UNAUTHENTICATED":
            return cause.details() if callable(getattr(cause, "details", None)) else str(cause)
        cause = cause.__cause__ or cause.__context__
    return None


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


def _open_lite(path: str, dedicated: bool = False):
    path = os.path.abspath(path).rstrip("/")
    with _lock:
        if path in _owned:
            return _client(f"http://127.0.0.1:{_owned[path][2]}", dedicated=dedicated)
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
            return _client(f"http://127.0.0.1:{port}", dedicated=dedicated)
        except OSError as exc:
            raise StoreUnavailable(f"cannot open the Milvus Lite store {path}: {exc}") from None
        _owned[path] = (server, engine, port)
        tmp = f"{endpoint_file(path)}.{os.getpid()}"
        with open(tmp, "w") as handle:
            json.dump({"pid": os.getpid(), "port": port}, handle)
        os.replace(tmp, endpoint_file(path))
    return _client(f"http://127.0.0.1:{port}", dedicated=dedicated)


def connect(uri: str, dedicated: bool = False):
    """A ``MilvusClient`` for ``uri`` (the token from ``MILVUS_TOKEN``); StoreUnavailable names the URI.

    ``dedicated``: a connection of its own. pymilvus shares one gRPC channel per address between its
    clients and, once that channel failed to reconnect (the server was down), hands the broken one to
    every new client of the address; a dedicated one is closed with its client, so a new one really
    connects again (the retriever does this after a failure).
    """
    if is_lite(uri):
        return _open_lite(uri, dedicated)
    return _client(uri, os.environ.get(TOKEN_ENV), dedicated)


def close(client) -> None:
    """Close ``client`` (and its connection, when dedicated); errors of a dead connection are ignored."""
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing what already failed
        pass


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


def settle(client, uri: str, collection: str, timeout: float = 600.0) -> bool:
    """Wait until what was flushed is indexed, so searches use the index; False when it cannot tell.

    Milvus Lite: a flush returns before its background worker has merged segments and built their
    HNSW graphs, and ``describe_index`` reports "Finished" all along; until the worker is done,
    searches scan the unindexed segments one vector at a time (~100× slower at 100k vectors).
    Only the process that opened the file holds the engine; a file opened by another process
    settles on its own. A Milvus server builds the index of flushed segments in the background
    too, but says how far it got (``pending_index_rows``); this waits for it.
    """
    if not is_lite(uri):
        return _settle_server(client, collection, timeout)
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


#: How long to wait, once the index is built, for the query node to load it (it takes ~10 s).
HANDOFF_WAIT_S = 120.0
#: After the load, searches move to the loaded segments within ~2 s; no API tells when.
HANDOFF_SWITCH_S = 3.0


def _settle_server(client, collection: str, timeout: float) -> bool:
    """Wait for the index build of every flushed row, then for the query node to serve the built segments.

    Until then (~10 s after the build on Milvus 2.3 standalone) searches still go to the interim
    index of the unsealed rows: recall@10 0.90 instead of 0.99 at 20k vectors. A server loads a
    sealed segment once its index is built (or at once when it is too small to get one), so the
    sealed rows it holds catch up with the indexed rows; searches switch to them a moment later.
    """
    deadline = time.monotonic() + timeout
    loaded = "Loaded" in str(client.get_load_state(collection).get("state", ""))
    built_at = None
    while True:
        index = vector_index(client, collection)
        if "pending_index_rows" not in index:
            return False
        indexed = int(index.get("indexed_rows", 0))
        if int(index["pending_index_rows"]) == 0 and indexed >= int(index.get("total_rows", 0)):
            if not loaded:
                return True
            built_at = built_at or time.monotonic()
            deadline = min(deadline, built_at + HANDOFF_WAIT_S)
            try:
                segments = client.list_loaded_segments(collection)
            except Exception:  # noqa: BLE001 - milvus-lite's own server does not implement it: cannot tell
                return False
            if sum(s.num_rows for s in segments) >= indexed:
                time.sleep(HANDOFF_SWITCH_S)
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def collection_dim(client, collection: str, timeout: float | None = None) -> int | None:
    """The vector dimension of ``collection`` (None when it does not exist)."""
    if not client.has_collection(collection, timeout=timeout):
        return None
    for field in client.describe_collection(collection, timeout=timeout)["fields"]:
        if field["name"] == VECTOR:
            return int(field["params"]["dim"])
    return None


def vector_index(client, collection: str, timeout: float | None = None) -> dict:
    """The index of the collection's vector field as ``describe_index`` gives it ({} when none)."""
    return client.describe_index(collection, VECTOR, timeout=timeout) or {}


def search_params(index: dict, k: int) -> dict:
    """Search parameters for ``index``: HNSW gets ``ef`` ≥ k (recall), FLAT nothing."""
    params = {"metric_type": index.get("metric_type", "COSINE")}
    if index.get("index_type", "").startswith("HNSW"):
        params["params"] = {"ef": max(64, 2 * k)}
    return params


def search(client, collection: str, vectors, k: int, params: dict,
           timeout: float | None = None) -> list[list[tuple[str, float, str]]]:
    """Top-``k`` (id, score, document json) per query vector, best first (``timeout``: seconds, then an error)."""
    hits = client.search(collection, data=[list(map(float, v)) for v in vectors], limit=k,
                         output_fields=[DOCUMENT], search_params=params, anns_field=VECTOR, timeout=timeout)
    return [[(str(h["id"]), float(h["distance"]), h["entity"].get(DOCUMENT, "null")) for h in row] for row in hits]
