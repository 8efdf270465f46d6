"""Triton python-backend model ``retriever``: embeddings → top-k ids, scores and documents from Milvus.

Inputs: ``embedding`` (FP32, one row per query) and optional ``top_k`` (INT32). Outputs, one row per
query and k columns, best first: ``ids`` (STRING), ``scores`` (FP32, cosine similarity) and
``documents`` (STRING, each a JSON object: text or image, and metadata).

The store is opened on the first request, not at load: an unreachable store answers each request
with an error naming its URI (within ``REQUEST_TIMEOUT_S`` when the server hangs) while every other
model of the server keeps serving, and the next request connects again: searches succeed once the
store is back, with nothing restarted.
"""

from __future__ import annotations

import time

import numpy as np

try:  # the build imports this module as part of forge.in_triton
    from .. import forge_glue
    from . import forge_store
except ImportError:  # inside a repository both sit next to model.py
    import forge_glue
    import forge_store

MAX_K = 1024
#: How long a looked-up index type is trusted: asking for it costs a round trip per request (~1.6 ms
#: on a Milvus server, more than half of an HNSW search), and ``forge index`` may switch FLAT to HNSW.
INDEX_TTL_S = 10.0
#: Longest wait for one call to the store (a server that stops answering without closing connections).
REQUEST_TIMEOUT_S = 10.0


class Retriever:
    """A collection of one store, searched by embedding; reconnects after a failure."""

    def __init__(self, uri: str, collection: str, default_k: int = 5):
        self.uri, self.collection, self.default_k = uri, collection, default_k
        self.client = None
        self.dim: int | None = None
        self.index: dict | None = None
        self.index_at = 0.0

    def _open(self) -> None:
        client = forge_store.connect(self.uri, dedicated=True)  # its own channel: closed after a failure
        try:
            dim = forge_store.collection_dim(client, self.collection, timeout=REQUEST_TIMEOUT_S)
            if dim is None:
                raise forge_store.StoreUnavailable(
                    f"collection {self.collection!r} does not exist in {self.uri}; run 'forge index' first")
            state = str(client.get_load_state(self.collection, timeout=REQUEST_TIMEOUT_S).get("state", ""))
            if "Loading" in state:  # a server that just started loads its collections again: seconds
                raise forge_store.StoreUnavailable(
                    f"collection {self.collection!r} of the Milvus store at {self.uri} is loading (the server "
                    "started a moment ago); try again in a few seconds")
            if "Loaded" not in state:
                client.load_collection(self.collection, timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - pymilvus raises several kinds
            forge_store.close(client)
            if isinstance(exc, forge_store.StoreUnavailable):
                raise
            raise forge_store.StoreUnavailable(self._unreachable(exc)) from None
        self.client, self.dim = client, dim

    def _unreachable(self, exc: Exception) -> str:
        code = exc.code() if callable(getattr(exc, "code", None)) else None  # a grpc error
        if getattr(code, "name", "") == "DEADLINE_EXCEEDED":
            why = f"no answer within {REQUEST_TIMEOUT_S:g} s"
        elif code is not None and callable(getattr(exc, "details", None)):
            why = f"{code.name}: {exc.details()}"
        else:
            why = str(getattr(exc, "message", exc)).splitlines()[0]
        return f"the Milvus store at {self.uri} failed this search: {why}; the next search connects again"

    def search(self, embedding: np.ndarray, k: int) -> list[list[tuple[str, float, str]]]:
        if embedding.ndim != 2 or embedding.shape[0] == 0:
            raise ValueError(f"embedding must hold one row per query, got shape {list(embedding.shape)}")
        if not 1 <= k <= MAX_K:
            raise ValueError(f"top_k must be between 1 and {MAX_K}, got {k}")
        for attempt in (0, 1):
            fresh = self.client is None
            if fresh:
                self._open()
            if embedding.shape[1] != self.dim:
                raise ValueError(f"the embedding has {embedding.shape[1]} values but collection "
                                 f"{self.collection!r} holds vectors of {self.dim}")
            try:
                if self.index is None or time.monotonic() - self.index_at > INDEX_TTL_S:
                    self.index = forge_store.vector_index(self.client, self.collection, timeout=REQUEST_TIMEOUT_S)
                    self.index_at = time.monotonic()
                params = forge_store.search_params(self.index, k)
                return forge_store.search(self.client, self.collection, embedding, k, params,
                                          timeout=REQUEST_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a dropped connection: a new one, tried once
                forge_store.close(self.client)
                self.client, self.index = None, None
                if attempt or fresh:  # a connection made just now failed: the store is down, not the channel
                    raise forge_store.StoreUnavailable(self._unreachable(exc)) from None
        raise AssertionError("unreachable")


def as_tensors(rows: list[list[tuple[str, float, str]]]) -> dict[str, np.ndarray]:
    """``ids`` / ``scores`` / ``documents`` arrays; rows with fewer hits are padded (id "", score -inf)."""
    width = max((len(r) for r in rows), default=0)
    ids = np.full((len(rows), width), b"", dtype=object)
    scores = np.full((len(rows), width), -np.inf, dtype=np.float32)
    documents = np.full((len(rows), width), b"null", dtype=object)
    for i, row in enumerate(rows):
        for j, (hit_id, score, document) in enumerate(row):
            ids[i, j], scores[i, j], documents[i, j] = hit_id.encode(), score, document.encode()
    return {"ids": ids, "scores": scores, "documents": documents}


class TritonPythonModel:
    """Triton's entry point."""

    def initialize(self, args):
        params = forge_glue.parameters(forge_glue.model_config(args))
        self.retriever = Retriever(params["store"], params["collection"], int(params.get("default_k", "5")))

    def execute(self, requests):
        def handle(request):
            embedding = forge_glue.get(request, "embedding")
            top_k = forge_glue.get(request, "top_k")
            k = int(top_k.reshape(-1)[0]) if top_k is not None and top_k.size else self.retriever.default_k
            try:
                rows = self.retriever.search(np.asarray(embedding, dtype=np.float32), k)
            except forge_store.StoreUnavailable as exc:
                raise RuntimeError(str(exc)) from None
            return as_tensors(rows)

        return forge_glue.run_each(requests, handle, "retriever")
