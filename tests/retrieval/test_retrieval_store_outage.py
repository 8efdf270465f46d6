"""A Milvus server that goes away and comes back (issue 33): searches fail one by one, then succeed again.

A real Milvus standalone server (the PyPI package ``milvus``) is stopped under the retriever of a
served repository (its ``Retriever``, the code tritonserver runs) and started again on the same port:
each search in between fails within bounded time with an error naming the store, and once the server
has loaded the collection again a search succeeds, with nothing restarted on forge's side.
"""

from __future__ import annotations

import platform
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.heavy

DIM = 8
#: The longest a failing search may take: a connection attempt plus one call that gets no answer.
BOUND_S = 30.0


@pytest.fixture
def milvus_server(tmp_path):
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("the PyPI package milvus ships its standalone server for Linux x86-64 only")
    from retrieval_fixtures import milvus_server as start

    server = start(tmp_path / "milvus")
    try:
        yield server
    finally:
        server.stop()


def _search(retriever, vector) -> tuple[float, object]:
    started = time.monotonic()
    try:
        result = retriever.search(vector, k=1)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        result = exc
    return time.monotonic() - started, result


def test_searches_fail_while_the_milvus_server_is_down_and_succeed_once_it_is_back(milvus_server):
    from forge.retrieval import store
    from forge.in_triton.retriever import forge_store
    from forge.in_triton.retriever.model import Retriever

    port = milvus_server.listen_port
    uri = f"http://127.0.0.1:{port}"
    vectors = np.eye(DIM, dtype=np.float32)
    with store.opened(uri) as client:
        store.create_collection(client, "docs", DIM, rows=DIM)
        client.insert("docs", [{forge_store.ID: str(i), forge_store.VECTOR: v.tolist(), forge_store.DOCUMENT: "{}",
                                forge_store.CONTENT_HASH: ""} for i, v in enumerate(vectors)])
        client.flush("docs")
    retriever = Retriever(uri, "docs")
    assert retriever.search(vectors[3:4], k=1)[0][0][0] == "3"

    milvus_server.stop()
    for _ in range(2):  # the connection it had, then a new one: each a clear error, at once
        took, error = _search(retriever, vectors[:1])
        assert isinstance(error, forge_store.StoreUnavailable) and uri in str(error), error
        assert took < BOUND_S, f"a search took {took:.1f} s to fail"
        print(f"store down: {error} ({took:.1f} s)")

    milvus_server.listen_port = port  # the same address the repository names
    milvus_server.start()
    back = time.monotonic()
    while True:  # a restarted server loads its collections again before it searches them
        took, result = _search(retriever, vectors[5:6])
        assert took < BOUND_S, f"a search took {took:.1f} s"
        if not isinstance(result, Exception):
            break
        assert isinstance(result, forge_store.StoreUnavailable) and uri in str(result), result
        assert time.monotonic() - back < 120, f"no search succeeded within 120 s of the restart: {result}"
        time.sleep(1)
    print(f"searches succeed {time.monotonic() - back:.1f} s after the server started again")
    assert result[0][0][0] == "5"
