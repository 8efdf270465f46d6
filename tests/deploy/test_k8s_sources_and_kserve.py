"""Where the pods find the repository (``--model-source pvc|init|image``) and ``--kserve``."""

from __future__ import annotations

from k8s_helpers import by_kind, deploy, read_dir


def pod(out) -> dict:
    return by_kind(read_dir(out))["Deployment"]["spec"]["template"]["spec"]


def test_pvc_with_a_named_claim(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--model-source", "pvc", "--pvc", "llm-weights") == 0
    volumes = {v["name"]: v for v in pod(out)["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "llm-weights"


def test_init_container_copies_the_repository(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--model-source", "init", "--model-uri", "s3://models/tp1") == 0
    spec = pod(out)
    (init,) = spec["initContainers"]
    assert init["image"] == "kserve/storage-initializer:v0.20.0"
    assert init["args"] == ["s3://models/tp1", "/models/tp1"]
    assert init["volumeMounts"] == [{"name": "models", "mountPath": "/models/tp1"}]
    assert {v["name"]: v for v in spec["volumes"]}["models"] == {"name": "models", "emptyDir": {}}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models/tp1", "readOnly": True}


def test_oci_image_volume(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--model-source", "image", "--model-image", "registry.example/repos/tp1:1") == 0
    volumes = {v["name"]: v for v in pod(out)["volumes"]}
    assert volumes["models"]["image"] == {"reference": "registry.example/repos/tp1:1", "pullPolicy": "IfNotPresent"}


def test_kserve_runtime_and_inference_service(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--kserve", "--replicas", 2) == 0
    kinds = by_kind(read_dir(out))
    assert set(kinds) == {"ConfigMap", "ServingRuntime", "InferenceService"}
    runtime, isvc = kinds["ServingRuntime"], kinds["InferenceService"]
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    assert [p["containerPort"] for p in container["ports"]] == [9000]  # KServe routes one port: the OpenAI API
    assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "openai"}
    assert {v["name"] for v in runtime["spec"]["volumes"]} == {"dshm", "entrypoint"}  # KServe mounts the model
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"] == {"name": "forge-triton"} and model["runtime"] == runtime["metadata"]["name"]
    assert runtime["spec"]["supportedModelFormats"][0]["name"] == "forge-triton"
    assert model["storageUri"] == "pvc://forge-models/tp1"
    assert model["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert isvc["spec"]["predictor"]["minReplicas"] == 2
    entry = kinds["ConfigMap"]["data"]["entrypoint.sh"]
    assert 'repository="${FORGE_REPOSITORY:-/mnt/models}"' in entry  # where KServe puts storageUri
    assert "--served-model-name tp1" in entry


def test_kserve_storage_uri_follows_the_model_source(repos, tmp_path):
    cases = {("--model-source", "init", "--model-uri", "gs://bucket/tp1"): "gs://bucket/tp1",
             ("--model-source", "image", "--model-image", "registry.example/tp1:1"): "oci://registry.example/tp1:1"}
    for i, (argv, uri) in enumerate(cases.items()):
        out = tmp_path / f"k8s{i}"
        assert deploy(repos["tp1"], out, "--kserve", *argv) == 0
        assert by_kind(read_dir(out))["InferenceService"]["spec"]["predictor"]["model"]["storageUri"] == uri
