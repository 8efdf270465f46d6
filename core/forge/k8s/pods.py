"""The pods: the entrypoint script every pod runs, and the pod specs of the leader (or only pod) and the workers.

The leader runs ``forge serve`` on the repository, the command ``forge serve`` runs anywhere: tritonserver, its
ranks, the OpenAI API with ``/health/ready`` and the supervisor. A group of several pods (a LeaderWorkerSet) is
one MPI world: the leader's mpirun starts the ranks of the other pods through ``kubectl exec``
(``/etc/forge/kubessh``, Open MPI's remote shell, the way NVIDIA's TensorRT-LLM example for LeaderWorkerSet
does it), with a hostfile of the group's pod names. A tensor-parallel python model's followers are started by
``forge serve``'s own mpirun (Open MPI reads the hostfile and the remote shell from ``OMPI_MCA_*``/``PRTE_MCA_*``
variables) and meet rank 0 at the leader's pod IP; an LLM-API model runs under TensorRT-LLM's
``trtllm-llmapi-launch``, whose rank 0 runs ``forge serve`` and whose other ranks are the LLM API's workers.
"""

from __future__ import annotations

import shlex
from typing import Any

from .plan import DRAIN_TIMEOUT_S, Plan

CONTAINER = "forge"
ENTRYPOINT_DIR = "/etc/forge"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}  # forge serve's defaults
READY_PATH = "/health/ready"  # the OpenAI front: tritonserver and every model it serves are ready
LIVE_PATH = "/health"  # the OpenAI front: tritonserver answers (vLLM's process-only check)
PROBE_PERIOD_S = 10
WORKER_WAIT_S = 600  # how long the leader waits for its workers' pods to run


def serve_argv(plan: Plan, host: str = "0.0.0.0") -> list[str]:
    """The ``forge serve`` command line of the leader (or only pod)."""
    o = plan.options
    return ["forge", "serve", plan.repo_path, "--host", host, "--http-port", str(PORTS["http"]),
            "--grpc-port", str(PORTS["grpc"]), "--metrics-port", str(PORTS["metrics"]),
            "--openai-port", str(PORTS["openai"]), "--served-model-name", str(o.served_model_name),
            "--drain-timeout", str(DRAIN_TIMEOUT_S)]


def _hostfile_lines(plan: Plan) -> list[str]:
    """Lines writing the group's hostfile (one line per pod, one slot per GPU) and pointing Open MPI at it."""
    slots = plan.gpus_per_pod
    return [
        "# the group's pods by name (the leader first: rank 0 is on it), one slot per GPU; kubessh reaches them",
        'hostfile="$(mktemp "${TMPDIR:-/tmp}/forge-hostfile.XXXXXX")"',
        f'echo "$POD_NAME slots={slots}" > "$hostfile"',
        'for i in $(seq 1 $((LWS_GROUP_SIZE - 1))); do',
        f'  echo "$POD_NAME-$i slots={slots}" >> "$hostfile"',
        "done",
        "# Open MPI 4 (orte) and 5 (prte) read their hostfile and remote shell from the environment",
        'export OMPI_MCA_orte_default_hostfile="$hostfile" PRTE_MCA_prte_default_hostfile="$hostfile"',
        f"export OMPI_MCA_plm_rsh_agent={ENTRYPOINT_DIR}/kubessh PRTE_MCA_plm_ssh_agent={ENTRYPOINT_DIR}/kubessh",
        f"# the workers' pods start beside the leader (startupPolicy LeaderCreated); wait up to {WORKER_WAIT_S} s",
        f"deadline=$((SECONDS + {WORKER_WAIT_S}))",
        'for i in $(seq 1 $((LWS_GROUP_SIZE - 1))); do',
        '  until [ "$(kubectl get pod "$POD_NAME-$i" -o jsonpath=\'{.status.phase}\' 2>/dev/null)" = Running ]; do',
        '    if [ "$SECONDS" -ge "$deadline" ]; then',
        '      echo "forge: error: worker pod $POD_NAME-$i is not running after ' + str(WORKER_WAIT_S) + ' s" >&2',
        "      exit 1",
        "    fi",
        "    sleep 2",
        "  done",
        "done",
    ]


def entrypoint_script(plan: Plan) -> str:
    """The bash script of ConfigMap ``NAME-entrypoint``: ``leader`` (or the only pod), or ``worker``."""
    lines = ["#!/bin/bash",
             f"# forge deploy k8s: what each pod of {plan.name} runs ({plan.repo.name}, {plan.group_ranks} rank(s) over "
             f"{plan.nodes} pod(s))",
             "# leader: forge serve (tritonserver, the OpenAI API on port "
             f"{PORTS['openai']}, /health/ready, restarts of dead model processes)",
             "set -euo pipefail",
             # the repository's path in the pod; FORGE_REPOSITORY runs the same script on another copy
             f'repository="${{FORGE_REPOSITORY:-{plan.repo_path}}}"',
             'case "${1:-leader}" in', "  leader)"]
    serve = serve_argv(plan, host="$POD_IP" if plan.wiring == "followers" else "0.0.0.0")
    serve[2] = "$repository"
    quoted = " ".join(f'"{a}"' if a.startswith("$") else shlex.quote(a) for a in serve)
    body: list[str] = []
    if plan.wiring == "one-pod":
        body.append(f"exec {quoted}")
    elif plan.wiring == "followers":
        body += _hostfile_lines(plan)
        body += ["# forge serve's mpirun places ranks by slot over the hostfile; the followers meet rank 0 at the "
                 "leader's pod IP",
                 f"exec {quoted}"]
    else:
        body += _hostfile_lines(plan)
        body += ["# TensorRT-LLM's launcher: rank 0 runs forge serve, the other ranks serve the LLM API's workers",
                 f"exec mpirun --allow-run-as-root --bind-to none -np {plan.group_ranks} trtllm-llmapi-launch {quoted}"]
    lines += [f"    {line}" for line in body]
    lines += ["    ;;", "  worker)"]
    if plan.nodes > 1:
        lines += ["    # the leader's mpirun starts this pod's ranks (kubectl exec); this process keeps the pod up",
                  "    trap 'exit 0' TERM INT",
                  "    while :; do sleep 3600 & wait $!; done",
                  "    ;;"]
    else:
        lines += ['    echo "forge: error: this deployment has one pod; it has no workers" >&2', "    exit 2", "    ;;"]
    lines += ["  *)", '    echo "forge: error: $1: the role is leader or worker" >&2', "    exit 2", "    ;;", "esac"]
    return "\n".join(lines) + "\n"


def kubessh_script(plan: Plan) -> str:
    """Open MPI's remote shell for the group: run a command in the named pod's forge container."""
    return "\n".join([
        "#!/bin/sh",
        f"# forge deploy k8s: Open MPI's remote shell for {plan.name}'s groups (OMPI_MCA_plm_rsh_agent): the first",
        "# argument is a pod of the group, the rest the command to run there (kubectl exec, the pod's service account)",
        'pod="$1"',
        "shift",
        f'exec kubectl exec "$pod" -c {CONTAINER} -- /bin/sh -c "$*"',
    ]) + "\n"


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "openai"}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def probes(plan: Plan) -> dict[str, Any]:
    """Startup (weights loading) and readiness on ``/health/ready``, liveness on the process-only ``/health``."""
    return {
        # every model ready; until then no other probe runs, so loading the weights restarts nothing
        "startupProbe": _probe(READY_PATH, PROBE_PERIOD_S, -(-plan.startup_budget_s // PROBE_PERIOD_S)),
        # out of the Service while a model is not ready (forge serve restarting a dead model process) or draining
        "readinessProbe": _probe(READY_PATH, PROBE_PERIOD_S, 3),
        # tritonserver answers; a long generation does not make it fail, so a busy engine is never restarted
        "livenessProbe": _probe(LIVE_PATH, PROBE_PERIOD_S, 6),
    }


def volumes(plan: Plan, *, kserve: bool = False) -> tuple[list[dict], list[dict]]:
    """(volumes, the forge container's mounts): the repository (not for KServe, which mounts it), /dev/shm, the scripts."""
    o = plan.options
    vols: list[dict] = []
    mounts: list[dict] = []
    if not kserve:
        if o.model_source == "pvc":
            vols.append({"name": "models", "persistentVolumeClaim": {"claimName": o.pvc, "readOnly": True}})
            mounts.append({"name": "models", "mountPath": plan.repo_path, "subPath": plan.repo.name, "readOnly": True})
        elif o.model_source == "init":
            vols.append({"name": "models", "emptyDir": {}})
            mounts.append({"name": "models", "mountPath": plan.repo_path, "readOnly": True})
        else:  # an OCI image (or artifact) whose files are the repository
            vols.append({"name": "models", "image": {"reference": o.model_image, "pullPolicy": "IfNotPresent"}})
            mounts.append({"name": "models", "mountPath": plan.repo_path, "readOnly": True})
    vols += [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": plan.shm_size}},
             {"name": "entrypoint", "configMap": {"name": f"{plan.name}-entrypoint", "defaultMode": 0o555}}]
    mounts += [{"name": "dshm", "mountPath": "/dev/shm"},
               {"name": "entrypoint", "mountPath": ENTRYPOINT_DIR, "readOnly": True}]
    return vols, mounts


def init_containers(plan: Plan) -> list[dict]:
    """``--model-source init``: KServe's storage initializer copies the repository into the pod's volume."""
    o = plan.options
    if o.model_source != "init" or o.kserve:
        return []
    return [{"name": "fetch-repository", "image": o.init_image, "args": [o.model_uri, plan.repo_path],
             "volumeMounts": [{"name": "models", "mountPath": plan.repo_path}]}]


def environment(plan: Plan) -> list[dict]:
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if plan.options.api_key_secret:
        # forge serve reads FORGE_API_KEY when --api-key is not given; the key never appears in a manifest
        env.append({"name": "FORGE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": plan.options.api_key_secret, "key": "api-key"}}})
    return env


def resources(plan: Plan) -> dict[str, Any]:
    if not plan.gpus_per_pod:
        return {}
    return {"limits": {plan.options.gpu_resource: str(plan.gpus_per_pod)}}


def container(plan: Plan, role: str, *, kserve: bool = False) -> dict[str, Any]:
    """The forge container of a leader (or only) pod, or of a worker."""
    _, mounts = volumes(plan, kserve=kserve)
    spec: dict[str, Any] = {"name": "kserve-container" if kserve else CONTAINER, "image": plan.options.image,
                            "command": ["bash", f"{ENTRYPOINT_DIR}/entrypoint.sh", role],
                            "env": environment(plan)}
    if role == "leader":
        ports = {"openai": PORTS["openai"]} if kserve else PORTS  # KServe routes its one port: the OpenAI API
        spec["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()]
        spec.update(probes(plan))
    if plan.gpus_per_pod:
        spec["resources"] = resources(plan)
    spec["volumeMounts"] = mounts
    return spec


def pod_spec(plan: Plan, role: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod spec of the leader (or only pod) or a worker."""
    vols, _ = volumes(plan)
    spec: dict[str, Any] = {
        # the pause container is PID 1 and reaps what the model processes leave (docker's --init does it in compose)
        "shareProcessNamespace": True,
        # forge serve drains for DRAIN_TIMEOUT_S on SIGTERM, then stops tritonserver
        "terminationGracePeriodSeconds": DRAIN_TIMEOUT_S + 30,
    }
    if plan.nodes > 1:
        spec["serviceAccountName"] = plan.name  # kubessh's kubectl exec into the group's pods
    if plan.node_selector:
        spec["nodeSelector"] = dict(plan.node_selector)
    inits = init_containers(plan)
    if inits:
        spec["initContainers"] = inits
    spec["containers"] = [container(plan, role)]
    spec["volumes"] = vols
    return spec
