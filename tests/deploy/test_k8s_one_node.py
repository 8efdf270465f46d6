"""``forge deploy k8s`` on one node: a Deployment and a Service running forge serve, probes on its health."""

from __future__ import annotations

import shlex

import yaml

from forge.cli import parser
from k8s_helpers import by_kind, deploy, read_dir


def leader_command(out, role: str = "leader") -> list[str]:
    """The command line the entrypoint's ``leader`` branch execs, variables left as written."""
    script = yaml.safe_load((out / "configmap-entrypoint.yaml").read_text())["data"]["entrypoint.sh"]
    branch = script.split(f"  {role})\n", 1)[1].split("\n    ;;", 1)[0]
    line = next(l.strip() for l in branch.splitlines() if l.strip().startswith("exec "))
    return shlex.split(line)[1:]


def test_one_rank_is_a_deployment_and_a_service(repos, tmp_path, capsys):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out) == 0
    assert "kubectl apply -k" in capsys.readouterr().out
    objects = read_dir(out)
    assert list(objects) == ["configmap-entrypoint.yaml", "deployment.yaml", "service.yaml"]
    kinds = by_kind(objects)
    deployment, service = kinds["Deployment"], kinds["Service"]
    assert deployment["metadata"]["name"] == "forge-tp1" and deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["bash", "/etc/forge/entrypoint.sh", "leader"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "http": (8000, "http"), "grpc": (8001, "grpc"), "metrics": (8002, "metrics"), "openai": (9000, "openai")}
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # the image: forge installed in the repository's NGC container, from the recipe written beside
    from forge.server import launch
    base, _ = launch.container_image(repos["tp1"])
    assert container["image"].startswith("forge-triton:") and container["image"].endswith(base.split(":")[1])
    assert f"FROM {base}\n" in (out / "image" / "Dockerfile").read_text()


def test_probes_ask_forge_serves_health_not_generation(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out) == 0
    container = by_kind(read_dir(out))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    startup, ready, live = container["startupProbe"], container["readinessProbe"], container["livenessProbe"]
    assert startup["httpGet"] == {"path": "/health/ready", "port": "openai"}
    assert ready["httpGet"] == {"path": "/health/ready", "port": "openai"}
    assert live["httpGet"] == {"path": "/health", "port": "openai"}  # process only: a busy engine stays alive
    # the startup budget covers loading: at least ten minutes before the first liveness check
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_budget_and_shared_memory_grow_with_the_model(repos, tmp_path):
    from forge.k8s import Options, make_plan

    small = make_plan(repos["tp1"], Options())
    assert small.shm_size == "2Gi" and small.startup_budget_s == 630
    big = (tmp_path / "big")
    import shutil
    shutil.copytree(repos["tp1"], big)
    with open(big / "tensorrt_llm" / "1" / "padding.bin", "wb") as f:
        f.truncate(130 * 2**30)  # sparse: 130 GiB of weights as far as the size says
    plan = make_plan(big, Options())
    assert plan.shm_size == "4Gi" and plan.startup_budget_s == 600 + 131 * 30


def test_shared_memory_is_memory_backed_and_the_repository_read_only(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--shm-size", "8Gi") == 0
    pod = by_kind(read_dir(out))["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["models"] == {"name": "models", "mountPath": "/models/tp1", "subPath": "tp1", "readOnly": True}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "forge-models", "readOnly": True}
    assert pod["shareProcessNamespace"] is True  # the pause container reaps orphaned model processes
    assert pod["terminationGracePeriodSeconds"] > 30  # forge serve drains for 30 s


def test_the_pod_runs_the_command_forge_serve_runs(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--served-model-name", "gpt-tiny") == 0
    argv = leader_command(out)
    assert argv[:3] == ["forge", "serve", "$repository"]
    args = parser("serve").parse_args(argv[1:])  # every flag is one of forge serve's
    assert (args.host, args.http_port, args.grpc_port, args.metrics_port, args.openai_port) == (
        "0.0.0.0", 8000, 8001, 8002, 9000)
    assert args.served_model_name == "gpt-tiny" and args.api_key is None


def test_tensor_parallel_on_one_node_gets_a_gpu_per_rank(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp2"], out) == 0
    kinds = by_kind(read_dir(out))
    assert "LeaderWorkerSet" not in kinds
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert leader_command(out)[:2] == ["forge", "serve"]  # forge serve starts both ranks (mpirun) itself


def test_llmapi_model_asks_for_its_tp_times_pp_gpus(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["llmapi-tp4pp2"], out, "--image", "registry.example/forge:1") == 0
    container = by_kind(read_dir(out))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}  # one tritonserver, the LLM API's 8 ranks
    assert container["image"] == "registry.example/forge:1"
    assert not (out / "image").exists()  # an image named: no recipe


def test_cpu_deployment_and_node_selectors(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--gpus-per-node", 0, "--node-selector", "pool=cpu",
                  "--node-selector", "kubernetes.io/arch=amd64") == 0
    pod = by_kind(read_dir(out))["Deployment"]["spec"]["template"]["spec"]
    assert "resources" not in pod["containers"][0]
    assert pod["nodeSelector"] == {"pool": "cpu", "kubernetes.io/arch": "amd64"}


def test_api_key_comes_from_a_secret(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--api-key-secret", "forge-key") == 0
    env = by_kind(read_dir(out))["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "FORGE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "forge-key", "key": "api-key"}}} in env
    assert "--api-key" not in leader_command(out)


def test_every_flag_is_named_in_every_file(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--autoscale", "hpa") == 0
    flags = [a for a in _help_flags() if a not in ("--out", "--help", "--debug", "--api-key")]
    for path in out.glob("*.yaml"):
        head = "".join(line for line in path.read_text().splitlines(True) if line.startswith("#"))
        missing = [flag for flag in flags if f"{flag} " not in head and f"{flag}\n" not in head]
        assert not missing, f"{path.name} does not name {missing}"


def _help_flags() -> list[str]:
    import argparse

    deploy_parser = parser("deploy")._subparsers._group_actions[0].choices["deploy"]
    k8s = next(a for a in deploy_parser._actions if isinstance(a, argparse._SubParsersAction)).choices["k8s"]
    return [s for a in k8s._actions for s in a.option_strings if s.startswith("--")]
