"""The files ``forge deploy k8s`` writes: YAML with comment headers, kustomization.yaml, the image recipe, and the
directory itself, assembled in a staging directory beside ``--out`` and renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from .. import __version__
from ..errors import UsageError
from . import helm, objects
from .plan import Plan

MARKER = ".forge-deploy-k8s"  # a directory forge wrote (and may replace)

WHAT = {
    "ConfigMap": "the entrypoint every pod runs (and, for several pods, kubessh: Open MPI's remote shell)",
    "Deployment": "one pod per replica: forge serve on the repository",
    "LeaderWorkerSet": "one group of pods per replica: the leader runs rank 0 and forge serve, the workers the other ranks",
    "Service": "the leaders' ports: Triton HTTP 8000, gRPC 8001, metrics 8002, the OpenAI API 9000",
    "ServiceAccount": "the leader's identity for kubessh (kubectl exec into its group's pods)",
    "Role": "what kubessh may do: read pods, exec into them, in this namespace",
    "RoleBinding": "the Role, granted to the ServiceAccount",
    "ServiceMonitor": "Prometheus scrapes the OpenAI API's /metrics (the queue depth) and Triton's metrics",
    "HorizontalPodAutoscaler": f"replicas from {objects.QUEUE_METRIC} per pod (prometheus-adapter's "
                               f"{objects.QUEUE_METRIC_ADAPTED})",
    "ScaledObject": f"KEDA: replicas from the sum of {objects.QUEUE_METRIC} (Prometheus)",
    "ServingRuntime": "KServe: the runtime serving forge repositories (forge serve on /mnt/models)",
    "InferenceService": "KServe: the repository (storageUri, mounted at /mnt/models) on the forge runtime",
}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    if "\n" in data:  # scripts read as scripts
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=10_000)


def header_for(plan: Plan, command: str):
    """A function writing the comment lines at the top of each file: what it is, from what, with which flags."""
    on, off = plan.options.flags()

    def header(name: str, obj: dict | None) -> str:
        what = WHAT.get(obj["kind"], obj["kind"]) if obj else {
            "kustomization.yaml": "kubectl apply -k DIR applies every object below",
            "Chart.yaml": "the Helm chart of forge serve for this repository",
            "values.yaml": "the chart's values"}.get(name, name)
        lines = [f"{name}: {what}",
                 f"written by {command} (forge {__version__}) from {plan.repo}",
                 f"{plan.group_ranks} rank(s), {plan.nodes} pod(s) per replica, "
                 f"{plan.gpus_per_pod} {plan.options.gpu_resource} per pod",
                 "flags: " + " ".join(on),
                 "not given: " + " ".join(off) + " (forge deploy k8s --help)"]
        return "".join(f"# {line}\n" for line in lines)

    return header


def recipe(plan: Plan) -> str | None:
    """``image/Dockerfile``: the profile's NGC container with forge installed (None: --image named one)."""
    if plan.image_recipe_base is None:
        return None
    wheel = f"forge_triton-{__version__}-py3-none-any.whl"
    lines = [f"# forge deploy k8s: the image the manifests of {plan.name} name ({plan.options.image}): the NGC",
             "# tritonserver container of the repository's backend profile with forge installed (forge serve, its",
             "# tritonserver and the OpenAI API). Build it beside forge's wheel, push it, and name it with --image:",
             "#   pip wheel --no-deps -w image/ FORGE_SOURCE_DIRECTORY",
             "#   docker build -t REGISTRY/forge-triton:TAG image/ && docker push REGISTRY/forge-triton:TAG",
             f"FROM {plan.image_recipe_base}",
             f"ARG FORGE_WHEEL={wheel}",
             "COPY ${FORGE_WHEEL} /tmp/",
             "ENV PIP_BREAK_SYSTEM_PACKAGES=1",
             'RUN python3 -m pip install --no-cache-dir "/tmp/${FORGE_WHEEL}[serve]" && rm "/tmp/${FORGE_WHEEL}"']
    if plan.nodes > 1:
        lines += ["# kubectl: kubessh, Open MPI's remote shell into the group's pods",
                  "ARG KUBECTL_VERSION=v1.35.0",
                  'RUN curl -fsSL -o /usr/local/bin/kubectl "https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/amd64'
                  '/kubectl" && chmod 0755 /usr/local/bin/kubectl']
    return "\n".join(lines) + "\n"


def render(plan: Plan, command: str) -> dict[str, str]:
    """Relative path → text of every file of the output directory."""
    header = header_for(plan, command)
    files: dict[str, str] = {}
    if plan.options.helm:
        files.update(helm.chart(plan, dump, header))
    else:
        built = objects.build(plan)
        for name, obj in built.items():
            files[name] = header(name, obj) + dump(obj)
        kustomization: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
        if plan.options.namespace:
            kustomization["namespace"] = plan.options.namespace
        kustomization["resources"] = list(built)
        files["kustomization.yaml"] = header("kustomization.yaml", None) + dump(kustomization)
    if plan.options.autoscale == "hpa" or (plan.options.helm and plan.options.autoscale != "keda"):
        files["extras/prometheus-adapter-values.yaml"] = (
            "# prometheus-adapter chart values (helm upgrade --install prometheus-adapter "
            "prometheus-community/prometheus-adapter -f THIS):\n"
            f"# {objects.QUEUE_METRIC} per pod in the custom-metrics API as {objects.QUEUE_METRIC_ADAPTED}, "
            "the name the HorizontalPodAutoscaler asks for\n" + dump(objects.adapter_rules()))
    image = recipe(plan)
    if image is not None:
        files["image/Dockerfile"] = image
    files[MARKER] = json.dumps({"forge": __version__, "repository": str(plan.repo), "command": command}) + "\n"
    return files


def write_tree(out: Path, files: dict[str, str]) -> None:
    """Write ``files`` as directory ``out``: staged beside it, then renamed; nothing partial is ever left."""
    out = Path(os.path.abspath(out))
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"--out {out}: directory {parent} does not exist")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file", hint="name a directory to write the manifests into")
    replacing = out.is_dir() and any(out.iterdir())
    if replacing and not (out / MARKER).is_file():
        raise UsageError(f"--out {out} is a directory with files forge did not write",
                         hint="name a new or empty directory (forge replaces only a directory it wrote)")
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write in {parent}: {exc.strerror or exc}") from None
    try:
        for rel, text in files.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        os.chmod(staging, 0o755)
        if out.is_dir():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=parent))
            os.rename(out, old / out.name)
            os.rename(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
