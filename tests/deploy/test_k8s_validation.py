"""Every object ``forge deploy k8s`` writes validates strictly, offline: core objects against the Kubernetes
schemas of the three newest minors kubernetes-validate ships, custom resources against their CRDs' schemas."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from k8s_helpers import deploy, minors, pods_of, read_dir, validate

CASES = {
    "one-node": ("tp1", []),
    "one-node-everything": ("tp1", ["--autoscale", "hpa", "--api-key-secret", "key", "--node-selector", "a=b",
                                    "--replicas", "2", "--namespace", "llm"]),
    "init": ("tp1", ["--model-source", "init", "--model-uri", "s3://b/tp1", "--autoscale", "keda"]),
    "image": ("tp1", ["--model-source", "image", "--model-image", "registry.example/tp1:1"]),
    "cpu": ("tp1", ["--gpus-per-node", "0"]),
    "tp2": ("tp2", []),
    "llmapi": ("llmapi", ["--image", "registry.example/forge:1"]),
    "lws-followers-keda": ("tp4", ["--gpus-per-node", "2", "--autoscale", "keda"]),
    "lws-followers-image": ("tp4", ["--gpus-per-node", "1", "--model-source", "image", "--model-image", "r.io/m:1"]),
    "lws-llmapi-hpa": ("llmapi-tp4pp2", ["--gpus-per-node", "4", "--image", "r.io/forge:1", "--autoscale", "hpa",
                                         "--model-source", "init", "--model-uri", "hf://org/model"]),
    "kserve": ("tp1", ["--kserve"]),
    "kserve-init": ("tp1", ["--kserve", "--model-source", "init", "--model-uri", "s3://b/tp1", "--node-selector",
                            "a=b", "--api-key-secret", "key"]),
    "kserve-image": ("tp2", ["--kserve", "--model-source", "image", "--model-image", "r.io/m:1"]),
}


def test_the_supported_minors_are_the_newest_three():
    assert len(minors()) == 3 and minors()[-1] >= "1.35"


@pytest.mark.parametrize("case", CASES)
def test_every_object_is_valid(repos, tmp_path, case):
    repo, argv = CASES[case]
    out = tmp_path / "k8s"
    assert deploy(repos[repo], out, *argv) == 0
    objects = read_dir(out)
    problems = []
    for name, obj in objects.items():
        problems += [f"{name}: {p}" for p in validate(obj)]
        for pod in pods_of(obj):  # the pod templates inside a CRD as Pods too, on every minor
            problems += [f"{name} (pod): {p}" for p in validate(pod)]
    assert not problems, "\n".join(problems)


def test_validation_catches_an_unknown_field(repos, tmp_path):
    """The checks above are strict: a misspelt field in a core object and in a custom resource both fail."""
    out = tmp_path / "k8s"
    assert deploy(repos["tp4"], out, "--gpus-per-node", "2", "--autoscale", "keda") == 0
    objects = read_dir(out)
    service = objects["service.yaml"]
    service["spec"]["selektor"] = {}
    assert any("selektor" in p for p in validate(service))
    lws = objects["leaderworkerset.yaml"]
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    assert any("sise" in p for p in validate(lws))
    lws["spec"]["leaderWorkerTemplate"].pop("sise")
    lws["spec"]["startupPolicy"] = "WhenReady"
    assert any("WhenReady" in p for p in validate(lws))
    scaled = objects["scaledobject.yaml"]
    scaled["spec"]["triggers"][0]["metdata"] = scaled["spec"]["triggers"][0].pop("metadata")
    assert validate(scaled)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (it runs kustomize offline)")
def test_kustomize_builds_the_directory(repos, tmp_path):
    import yaml

    out = tmp_path / "k8s"
    assert deploy(repos["tp4"], out, "--gpus-per-node", "2", "--autoscale", "hpa", "--namespace", "llm") == 0
    built = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert {d["kind"] for d in docs} == {obj["kind"] for obj in read_dir(out).values()}
    assert all(d["metadata"]["namespace"] == "llm" for d in docs)
