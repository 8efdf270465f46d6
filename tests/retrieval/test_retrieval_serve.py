"""The real all-MiniLM-L6-v2 + Milvus (Lite file and milvus-lite's gRPC server) served by the real tritonserver."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from encoder_fixtures import built, infer, serving
from retrieval_fixtures import CORPUS, QUERIES, index, search

from forge.cli import main

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def lite_repo(minilm_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lite")
    return built(root / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--store", str(root / "docs.db"), "--collection", "docs"), root / "docs.db"


def test_index_is_resumable_and_an_unchanged_corpus_does_no_work(lite_repo, corpus_file, tmp_path):
    repo, db = lite_repo
    manifest = json.loads((repo / "forge-manifest.json").read_text())
    assert manifest["spec"]["options"]["store"] == str(db) and manifest["spec"]["options"]["collection"] == "docs"
    half = tmp_path / "half.jsonl"
    half.write_text("".join(json.dumps(row) + "\n" for row in CORPUS[:3]))  # a run stopped half-way
    first = index(str(repo), str(half))
    assert (first["indexed"], first["dim"], first["index"]) == (3, 384, "FLAT")
    again = index(str(repo), str(corpus_file), "--batch-size", "2")
    assert (again["indexed"], again["unchanged"]) == (3, 3)
    assert index(str(repo), str(corpus_file))["indexed"] == 0


def test_search_finds_query_and_paraphrase_and_index_while_serving(lite_repo, corpus_file, tmp_path):
    repo, db = lite_repo
    if not index(str(repo), str(corpus_file))["documents"]:
        pytest.skip("nothing indexed")
    with serving(repo) as (server, client):
        url = server.http_url
        for query, paraphrase, expected in QUERIES:
            for text in (query, paraphrase):
                hits = search(url, text)
                assert hits[0]["id"] == expected, (text, hits)
                assert len(hits) == 3 and hits[0]["score"] > hits[1]["score"]
        top = search(url, "Paris landmark", k=1)[0]
        assert top["document"] == {"text": CORPUS[0]["text"], "metadata": {"topic": "travel"}}
        # the server's retriever holds the Lite file now; forge index reaches it through its endpoint
        more = tmp_path / "more.jsonl"
        more.write_text(json.dumps({"id": "tea", "text": "Green tea is brewed with water below boiling."}) + "\n")
        assert index(str(repo), str(more), "--url", url)["indexed"] == 1
        assert search(url, "how hot should the water be for tea", k=1)[0]["id"] == "tea"
        assert client.is_model_ready("ensemble")


def test_unreachable_store_is_a_per_request_error(minilm_model, tmp_path):
    """The search fails with the store's URI; the embedding ensemble of the same server keeps answering."""
    from tritonclient.utils import InferenceServerException

    from forge.server.processes import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--store", uri)
    with serving(repo) as (server, client):
        with pytest.raises(InferenceServerException, match=f"cannot reach the Milvus store at {uri}"):
            infer(client, "search_text", "text_input", ["anything"], output="ids")
        assert infer(client, "ensemble", "text_input", ["still embeds"]).shape == (1, 384)
        assert main(["search", "anything", "--url", server.http_url]) == 1


@pytest.fixture
def milvus_server(tmp_path):
    """milvus-lite's own gRPC server (the Milvus protocol, from the milvus-lite package) on a free port."""
    from forge.server.processes import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(tmp_path / "srv"),
                                "--host", "127.0.0.1", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from pymilvus import MilvusClient

    deadline = time.monotonic() + 60
    while True:
        try:
            MilvusClient(uri=f"http://127.0.0.1:{port}", timeout=2).list_collections()
            break
        except Exception:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise
            time.sleep(0.5)
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=30)


def test_server_uri(minilm_model, corpus_file, milvus_server, tmp_path):
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--store", milvus_server)
    with serving(repo) as (server, client):
        report = index(str(repo), str(corpus_file), "--url", server.http_url)
        assert report["store"] == milvus_server and report["indexed"] == len(CORPUS)
        hits = search(server.http_url, "coral in the ocean", k=2)
        assert hits[0]["id"] == "reef"
        scores = client.infer("search_text", _text_and_k("coral", 4)).as_numpy("scores")
        assert scores.shape == (1, 4) and np.all(np.diff(scores[0]) <= 0)


def _text_and_k(text: str, k: int):
    import tritonclient.http as http

    query = http.InferInput("text_input", [1, 1], "BYTES")
    query.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    top_k = http.InferInput("top_k", [1, 1], "INT32")
    top_k.set_data_from_numpy(np.array([[k]], dtype=np.int32))
    return [query, top_k]
