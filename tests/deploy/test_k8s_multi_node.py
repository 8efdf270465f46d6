"""More ranks than ``--gpus-per-node``: a LeaderWorkerSet whose group is the repository's ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import yaml

from forge.cli import parser
from k8s_helpers import by_kind, deploy, read_dir
from test_k8s_one_node import leader_command


def script(out, key: str = "entrypoint.sh") -> str:
    return yaml.safe_load((out / "configmap-entrypoint.yaml").read_text())["data"][key]


def test_python_tensor_parallel_over_two_nodes(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp4"], out, "--gpus-per-node", 2) == 0
    objects = read_dir(out)
    kinds = by_kind(objects)
    assert "Deployment" not in kinds
    assert {"ServiceAccount", "Role", "RoleBinding", "LeaderWorkerSet", "Service", "ConfigMap"} == set(kinds)
    lws = kinds["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # the leader is ready only with its workers running
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    assert leader["containers"][0]["command"][-1] == "leader" and worker["containers"][0]["command"][-1] == "worker"
    for pod in (leader, worker):
        assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        assert pod["serviceAccountName"] == "forge-tp4"
        assert {v["name"] for v in pod["volumes"]} == {"models", "dshm", "entrypoint"}
    assert "readinessProbe" in leader["containers"][0] and "readinessProbe" not in worker["containers"][0]
    # the Service reaches the leaders only (rank 0, the OpenAI API)
    assert kinds["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    rules = kinds["Role"]["rules"]
    assert {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]} in rules
    # forge serve starts the ranks (its mpirun) over the group's pods; the followers meet rank 0 at its pod IP
    argv = leader_command(out)
    assert argv[:2] == ["forge", "serve"] and parser("serve").parse_args(argv[1:]).host == "$POD_IP"
    text = script(out)
    assert 'echo "$POD_NAME slots=2" > "$hostfile"' in text and 'echo "$POD_NAME-$i slots=2" >> "$hostfile"' in text
    assert "OMPI_MCA_orte_default_hostfile" in text and "OMPI_MCA_plm_rsh_agent=/etc/forge/kubessh" in text
    assert 'exec kubectl exec "$pod" -c forge -- /bin/sh -c "$*"' in script(out, "kubessh")


def test_llmapi_tp4_pp2_over_two_nodes_runs_under_the_llm_apis_launcher(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["llmapi-tp4pp2"], out, "--gpus-per-node", 4, "--image", "registry.example/forge:1") == 0
    lws = by_kind(read_dir(out))["LeaderWorkerSet"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert leader["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    argv = leader_command(out)
    launcher = argv.index("trtllm-llmapi-launch")
    assert argv[:launcher] == ["mpirun", "--allow-run-as-root", "--bind-to", "none", "-np", "8"]
    serve = argv[launcher + 1:]
    assert serve[:2] == ["forge", "serve"] and parser("serve").parse_args(serve[1:]).host == "0.0.0.0"


def test_the_worker_keeps_its_pod_up_until_told_to_stop(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp4"], out, "--gpus-per-node", 2) == 0
    path = tmp_path / "entrypoint.sh"
    path.write_text(script(out))
    worker = subprocess.Popen(["bash", str(path), "worker"], start_new_session=True)
    try:
        time.sleep(1.0)
        assert worker.poll() is None
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=10) == 0
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def test_one_pod_has_no_worker_role(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out) == 0
    path = tmp_path / "entrypoint.sh"
    path.write_text(script(out))
    done = subprocess.run(["bash", str(path), "worker"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "has no workers" in done.stderr
    done = subprocess.run(["bash", str(path), "follower"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "the role is leader or worker" in done.stderr
