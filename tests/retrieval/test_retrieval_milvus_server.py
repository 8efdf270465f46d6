"""The URI path against a real Milvus standalone server (C++, HNSW), started from the PyPI package ``milvus``.

That package (Milvus 2.3.5 with embedded etcd, rocksmq and local storage; the ``test`` extra installs
it) is the only registry form of a Milvus server found that runs without Docker. Its server is started
with authentication on, so the token path (``MILVUS_TOKEN`` from the environment) is exercised too.
"""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
from encoder_fixtures import built, serving
from retrieval_fixtures import CORPUS, QUERIES, index, search

from forge.cli import main

pytestmark = pytest.mark.heavy

#: Milvus's built-in administrator with authentication on (user:password is a token).
ROOT_TOKEN = "root:Milvus"


@pytest.fixture(scope="module")
def milvus_standalone(tmp_path_factory):
    """``http://127.0.0.1:PORT`` of a Milvus standalone server with authentication on (free ports)."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("the PyPI package milvus ships its standalone server for Linux x86-64 only")
    import milvus

    data = tmp_path_factory.mktemp("milvus-standalone")
    server = milvus.MilvusServer(data_dir=str(data))
    server.config.set("authorization_enabled", True)  # MilvusServer(**kwargs) would ignore it
    try:
        server.start()
    except (TimeoutError, RuntimeError) as exc:
        server.stop()
        log = data / "logs" / "milvus-stderr.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"the Milvus standalone server did not start: {exc}\n{tail}") from None
    try:
        yield f"http://127.0.0.1:{server.listen_port}"
    finally:
        server.stop()


@pytest.fixture
def token(monkeypatch):
    """The administrator's token in the environment, where forge index and the retriever read it."""
    monkeypatch.setenv("MILVUS_TOKEN", ROOT_TOKEN)


def test_index_and_search_through_a_milvus_server(minilm_model, corpus_file, milvus_standalone, token, tmp_path):
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--store", milvus_standalone, "--collection", "docs")
    with serving(repo) as (server, client):
        first = index(str(repo), str(corpus_file), "--url", server.http_url)
        assert (first["store"], first["indexed"], first["dim"]) == (milvus_standalone, len(CORPUS), 384)
        # a second run right after the first sees its rows (read with Strong consistency): no work
        again = index(str(repo), str(corpus_file))
        assert (again["indexed"], again["unchanged"]) == (0, len(CORPUS))
        for query, paraphrase, expected in QUERIES:
            for text in (query, paraphrase):
                hits = search(server.http_url, text)
                assert hits[0]["id"] == expected, (text, hits)
        assert search(server.http_url, "Paris landmark", k=1)[0]["document"] == {
            "text": CORPUS[0]["text"], "metadata": {"topic": "travel"}}


def test_a_wrong_token_is_refused_in_one_line(minilm_model, corpus_file, milvus_standalone, monkeypatch,
                                              tmp_path, capsys):
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--store", milvus_standalone, "--collection", "docs")
    capsys.readouterr()  # the build's log
    for token, said in (("root:wrong", "refused the token in MILVUS_TOKEN"),
                        (None, "refused a connection without a token (MILVUS_TOKEN is not set)")):
        if token:
            monkeypatch.setenv("MILVUS_TOKEN", token)
        else:
            monkeypatch.delenv("MILVUS_TOKEN", raising=False)
        assert main(["index", str(repo), str(corpus_file)]) == 1
        error = capsys.readouterr().err.strip()
        assert f"the Milvus store at {milvus_standalone} {said}" in error and len(error.splitlines()) == 1, error


def test_hnsw_collection_on_a_server_is_indexed_before_index_returns(milvus_standalone, token):
    """forge's HNSW layout on the server: settle waits for the graph; the retriever's search finds each vector."""
    from forge.retrieval import store
    from forge.in_triton.retriever import forge_store
    from forge.in_triton.retriever.model import Retriever

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3000, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with store.opened(milvus_standalone) as client:
        if client.has_collection("hnsw"):
            client.drop_collection("hnsw")
        assert store.create_collection(client, "hnsw", 384, rows=store.HNSW_FROM) == "HNSW"
        client.insert("hnsw", [{forge_store.ID: str(i), forge_store.VECTOR: v.tolist(), forge_store.DOCUMENT: "{}",
                                forge_store.CONTENT_HASH: ""} for i, v in enumerate(vectors)])
        client.flush("hnsw")
        client.load_collection("hnsw")
        assert forge_store.settle(client, milvus_standalone, "hnsw", timeout=300)
        index = client.describe_index("hnsw", forge_store.VECTOR)
        assert (index["index_type"], index["indexed_rows"], index["pending_index_rows"]) == ("HNSW", 3000, 0)
    retriever = Retriever(milvus_standalone, "hnsw")
    rows = retriever.search(vectors[:5], k=3)
    assert [row[0][0] for row in rows] == ["0", "1", "2", "3", "4"]
    assert all(abs(row[0][1] - 1.0) < 1e-4 for row in rows)
    assert forge_store.search_params(retriever.index, 3) == {"metric_type": "COSINE", "params": {"ef": 64}}

