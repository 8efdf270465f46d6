"""Bad input to ``forge deploy k8s``: one line, exit 2, and nothing written (not even a staging directory).

Tried: a world size no --gpus-per-node divides, an image with a shell metacharacter, an API key on the command
line, an unwritable --out, and the other flags below.
"""

from __future__ import annotations

import pytest

from forge.cli import main

CASES = [
    (["{tp4}", "--gpus-per-node", "3"], "4 ranks do not fill whole nodes of --gpus-per-node 3"),
    (["{tp4}", "--gpus-per-node", "3"], "Use --gpus-per-node 2 (2 nodes)"),
    (["{tp1}", "--image", "forge;rm -rf /"], "--image 'forge;rm -rf /' is not a container image reference"),
    (["{tp1}", "--image", "forge:$(id)"], "is not a container image reference"),
    (["{tp1}", "--model-source", "image", "--model-image", "a b"], "--model-image 'a b' is not a container image"),
    (["{tp1}", "--api-key", "sk-123"], "takes no API key on the command line"),
    (["{tp1}", "--api-key", "sk-123"], "--api-key-secret NAME"),
    (["{tp1}", "--out", "/proc/forge-k8s"], "cannot write in /proc"),
    (["{tp1}", "--out", "/nonexistent/dir/k8s"], "directory /nonexistent/dir does not exist"),
    (["{tp1}", "--out", "{file}"], "is a file"),
    (["{tp1}", "--out", "{foreign}"], "a directory with files forge did not write"),
    (["{llmapi-tp4pp2}", "--gpus-per-node", "0", "--image", "r.io/f:1"], "--gpus-per-node 0 asks for no GPU"),
    (["{tp1}", "--gpus-per-node", "-1"], "--gpus-per-node -1: a count of GPUs"),
    (["{tp1}", "--name", "Forge_Tiny"], "--name 'Forge_Tiny' is not a Kubernetes name"),
    (["{tp1}", "--model-source", "init"], "--model-uri URI"),
    (["{tp1}", "--model-source", "image"], "--model-image IMAGE is missing"),
    (["{tp1}", "--model-source", "init", "--model-uri", "s3://b/$(id)"], "is not a URI"),
    (["{tp1}", "--model-uri", "s3://b/x"], "--model-uri does not apply here: it goes with --model-source init"),
    (["{tp1}", "--model-source", "image", "--model-image", "r.io/m:1", "--pvc", "c"],
     "--pvc does not apply here"),
    (["{tp1}", "--init-image", "r.io/i:1"], "--init-image does not apply here"),
    (["{tp1}", "--max-replicas", "3"], "--max-replicas does not apply here: it goes with --autoscale"),
    (["{tp1}", "--autoscale", "hpa", "--prometheus-url", "http://p:9090"], "--prometheus-url does not apply here"),
    (["{tp1}", "--kserve", "--autoscale", "keda"], "KServe scales its InferenceService itself"),
    (["{tp1}", "--kserve", "--helm"], "--helm does not apply here"),
    (["{tp4}", "--kserve", "--gpus-per-node", "2"], "span 2 nodes"),
    (["{tp1}", "--autoscale", "hpa", "--replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below --replicas 3"),
    (["{tp1}", "--replicas", "0"], "--replicas 0: at least 1"),
    (["{tp1}", "--autoscale", "keda", "--waiting-target", "0"], "--waiting-target 0"),
    (["{tp1}", "--node-selector", "gpu"], "--node-selector 'gpu' is not KEY=VALUE"),
    (["{tp1}", "--shm-size", "lots"], "--shm-size 'lots' is not a Kubernetes quantity"),
    (["{tp1}", "--gpu-resource", "gpu"], "--gpu-resource 'gpu' is not an extended resource name"),
    (["{tp1}", "--api-key-secret", "Key!"], "--api-key-secret 'Key!' is not a Kubernetes name"),
    (["{tp1}", "--autoscale", "knative"], "invalid choice: 'knative'"),
    (["/nonexistent/repo"], "/nonexistent/repo is not a directory"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_refused_in_one_line_with_nothing_written(repos, tmp_path, capsys, argv, message):
    where = tmp_path / "work"
    where.mkdir()
    (where / "a-file").write_text("x")
    foreign = where / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    names = {"file": where / "a-file", "foreign": foreign, **repos}
    argv = [a.format(**names) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(where / "k8s")]
    before = sorted(p.name for p in where.iterdir())
    code = main(["deploy", "k8s", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in where.iterdir()) == before  # no output, no staging directory left
    assert (foreign / "notes.txt").read_text() == "keep me" and sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_a_directory_forge_wrote_is_replaced_whole(repos, tmp_path):
    out = tmp_path / "k8s"
    assert main(["deploy", "k8s", str(repos["tp1"]), "--out", str(out), "--autoscale", "hpa"]) == 0
    assert (out / "horizontalpodautoscaler.yaml").is_file()
    assert main(["deploy", "k8s", str(repos["tp1"]), "--out", str(out)]) == 0
    assert not (out / "horizontalpodautoscaler.yaml").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["k8s"]
