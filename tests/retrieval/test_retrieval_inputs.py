"""What forge build / forge index refuse before any server starts (no tritonserver; a real Milvus Lite)."""

from __future__ import annotations

import json

import pytest
from encoder_fixtures import build, built

from forge.cli import main
from forge.errors import UsageError
from forge.retrieval import corpus, store


def test_corpus_ids_metadata_and_duplicates(tmp_path):
    texts = tmp_path / "a.txt"
    texts.write_text("first line\n\nsecond line\nfirst line\n")
    docs = corpus.read(texts)
    assert [json.loads(d.document)["text"] for d in docs] == ["first line", "second line"]  # same text, same id
    rows = tmp_path / "b.jsonl"
    rows.write_text(json.dumps({"id": 7, "text": "seven", "metadata": {"lang": "en"}, "source": "x"}) + "\n")
    (doc,) = corpus.read(rows)
    assert doc.id == "7" and json.loads(doc.document) == {"text": "seven", "metadata": {"source": "x", "lang": "en"}}
    rows.write_text(json.dumps({"id": "a", "text": "one"}) + "\n" + json.dumps({"id": "a", "text": "two"}) + "\n")
    with pytest.raises(UsageError, match=r"b.jsonl:2: duplicate id 'a' \(first at .*b.jsonl:1\)"):
        corpus.read(rows)


@pytest.mark.parametrize("content, message", [
    ("", "holds no documents"), ("\n  \n", "holds no documents"),
    ('{"id": 1}\n', 'needs a non-empty "text"'), ("not json\n", "not a JSON object")])
def test_bad_jsonl_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "c.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        corpus.read(path)


def test_unreadable_image_is_named(tmp_path):
    from forge.encoder.samples import synthetic_image

    (tmp_path / "ok.png").write_bytes(synthetic_image(32, 32, seed=1))
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(UsageError, match=r"broken.jpg: unreadable image"):
        corpus.read(tmp_path)
    with pytest.raises(UsageError, match="holds no documents"):
        empty = tmp_path / "empty"
        empty.mkdir()
        corpus.read(empty)


def test_store_uris(tmp_path):
    assert store.normalize_uri("rel.db") == str((tmp_path.cwd() / "rel.db").resolve())
    assert store.normalize_uri("http://milvus:19530") == "http://milvus:19530"
    with pytest.raises(UsageError, match="must not carry credentials") as refused:
        store.normalize_uri("http://root:secret@milvus:19530")
    assert "MILVUS_TOKEN" in refused.value.one_line()
    with pytest.raises(UsageError, match="neither a Milvus Lite path"):
        store.normalize_uri("milvus-host")
    with pytest.raises(UsageError, match="invalid collection name"):
        store.check_collection("my-docs")


def test_build_flags_are_checked(minilm_model, tmp_path, capsys):
    args = ["--family", "minilm", "--model", str(minilm_model), "--target", "python", "--out", str(tmp_path / "r")]
    assert build(*args, "--collection", "docs") == 2
    assert "--collection needs --store" in capsys.readouterr().err
    assert build(*args, "--store", str(tmp_path / "r" / "in.db")) == 2
    assert "inside the repository" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.heavy
def test_dimension_mismatch_is_refused_at_build_and_index(minilm_model, tmp_path, capsys):
    """A collection of 8-d vectors cannot take MiniLM's 384-d embeddings."""
    from forge.in_triton.retriever import forge_store

    db = str(tmp_path / "small.db")
    with store.opened(db) as client:
        store.create_collection(client, "docs", 8, 10)
    args = ["--family", "minilm", "--model", str(minilm_model), "--target", "python", "--store", db,
            "--collection", "docs"]
    assert build(*args, "--out", str(tmp_path / "r")) == 2
    assert "holds 8-dimensional vectors but the encoder of this build produces 384" in capsys.readouterr().err
    repo = built(tmp_path / "r2", *args[:-2], "--collection", "other")
    texts = tmp_path / "t.txt"
    texts.write_text("hello\n")
    assert main(["index", str(repo), str(texts), "--collection", "docs"]) == 2
    assert "holds 8-dimensional vectors" in capsys.readouterr().err
    assert not forge_store._owned  # the Lite store was released after the refusal


@pytest.mark.heavy
def test_unreachable_store_fails_index_in_one_line(minilm_model, tmp_path, capsys):
    from forge.server.processes import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    repo = built(tmp_path / "r", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--store", uri)
    texts = tmp_path / "t.txt"
    texts.write_text("hello\n")
    capsys.readouterr()
    assert main(["index", str(repo), str(texts)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"forge: error: cannot reach the Milvus store at {uri}") and "\n" not in err
