"""``--helm``: the same objects as a Helm chart, with values for the image, GPUs, replicas and autoscaling.

The templates are the objects dumped as YAML with a few values marked (:func:`value`) and replaced by Helm
expressions afterwards; nothing else of Helm's template language is used: ``{{ .Values.X }}``,
``{{ .Values.X | quote }}``, ``{{- toYaml .Values.X | nindent N }}`` and ``{{- if .Values.X }}`` around a file.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from .. import __version__
from . import objects
from .plan import Plan

_MARK = re.compile(r"'?@@forge:(.+?)@@'?")
_BLOCK = re.compile(r"^( *)([A-Za-z]+): '?@@forge-block:(.+?)@@'?$", re.M)


def value(expression: str) -> str:
    """A marker that becomes ``{{ expression }}`` in the template."""
    return f"@@forge:{expression}@@"


def _block(path: str) -> str:
    return f"@@forge-block:{path}@@"


def values(plan: Plan) -> dict[str, Any]:
    o = plan.options
    out: dict[str, Any] = {"image": o.image, "replicas": o.replicas}
    if plan.gpus_per_pod:
        out["gpusPerPod"] = plan.gpus_per_pod
    out["nodeSelector"] = dict(plan.node_selector)
    out["autoscaling"] = {"enabled": bool(o.autoscale), "maxReplicas": o.max_replicas,
                          "waitingTarget": o.waiting_target}
    out["serviceMonitor"] = {"enabled": bool(o.autoscale)}
    return out


def values_comments(plan: Plan) -> list[str]:
    kind = "HorizontalPodAutoscaler (prometheus-adapter)" if (plan.options.autoscale or "hpa") == "hpa" else \
        "KEDA ScaledObject"
    lines = ["image: the container every pod runs (forge serve)",
             "replicas: " + ("groups of pods (LeaderWorkerSet replicas)" if plan.nodes > 1 else "pods") +
             "; the autoscaler's minimum when autoscaling.enabled"]
    if plan.gpus_per_pod:
        lines.append(f"gpusPerPod: {plan.options.gpu_resource} of each pod: the ranks it runs (change it with the "
                     "repository's tp × pp and --gpus-per-node, not alone)")
    lines += ["nodeSelector: node labels every pod needs",
              f"autoscaling: a {kind} on {objects.QUEUE_METRIC} per replica "
              "(waitingTarget), up to maxReplicas",
              "serviceMonitor: Prometheus scrapes the OpenAI API's and Triton's /metrics"]
    return lines


def _mark_pod(spec: dict[str, Any], plan: Plan) -> None:
    for c in spec["containers"]:
        c["image"] = value(".Values.image | quote")
        if plan.gpus_per_pod:
            c["resources"]["limits"][plan.options.gpu_resource] = value(".Values.gpusPerPod | quote")
    spec["nodeSelector"] = _block("nodeSelector")


def _marked(name: str, obj: dict[str, Any], plan: Plan) -> tuple[dict[str, Any], str | None]:
    """(the object with its values marked, the value that turns the file on, if any)."""
    obj = copy.deepcopy(obj)
    kind = obj["kind"]
    if kind == "Deployment":
        obj["spec"]["replicas"] = value(".Values.replicas")
        _mark_pod(obj["spec"]["template"]["spec"], plan)
    elif kind == "LeaderWorkerSet":
        obj["spec"]["replicas"] = value(".Values.replicas")
        template = obj["spec"]["leaderWorkerTemplate"]
        _mark_pod(template["leaderTemplate"]["spec"], plan)
        _mark_pod(template["workerTemplate"]["spec"], plan)
    elif kind == "HorizontalPodAutoscaler":
        obj["spec"]["minReplicas"] = value(".Values.replicas")
        obj["spec"]["maxReplicas"] = value(".Values.autoscaling.maxReplicas")
        obj["spec"]["metrics"][0]["pods"]["target"]["averageValue"] = value(
            ".Values.autoscaling.waitingTarget | quote")
        return obj, ".Values.autoscaling.enabled"
    elif kind == "ScaledObject":
        obj["spec"]["minReplicaCount"] = value(".Values.replicas")
        obj["spec"]["maxReplicaCount"] = value(".Values.autoscaling.maxReplicas")
        obj["spec"]["triggers"][0]["metadata"]["threshold"] = value(".Values.autoscaling.waitingTarget | quote")
        return obj, ".Values.autoscaling.enabled"
    elif kind == "ServiceMonitor":
        return obj, ".Values.serviceMonitor.enabled"
    return obj, None


def template(text: str) -> str:
    """Marked YAML → Helm template text."""
    text = _BLOCK.sub(lambda m: f"{m[1]}{m[2]}:\n{{{{- toYaml .Values.{m[3]} | nindent {len(m[1]) + 2} }}}}", text)
    return _MARK.sub(lambda m: f"{{{{ {m[1]} }}}}", text)


def chart_objects(plan: Plan) -> dict[str, dict[str, Any]]:
    """The objects of the chart: those of the manifests, plus the autoscaler and ServiceMonitor (values turn them on)."""
    built = objects.build(plan)
    built.setdefault("servicemonitor.yaml", objects.service_monitor(plan))
    if plan.options.autoscale is None:
        # autoscaling.enabled: false unless set; the chart holds the HPA, prometheus-adapter's way
        built["horizontalpodautoscaler.yaml"] = objects.horizontal_pod_autoscaler(plan)
    return built


def chart(plan: Plan, dump, header) -> dict[str, str]:
    """File path (in the chart) → text. ``dump`` writes an object as YAML, ``header`` the comment lines of a file."""
    files: dict[str, str] = {}
    meta = {"apiVersion": "v2", "name": plan.name, "description": f"forge serve of {plan.repo.name} "
            f"({plan.group_ranks} rank(s), {plan.nodes} pod(s) per replica)", "type": "application",
            "version": __version__, "appVersion": __version__}
    files["Chart.yaml"] = header("Chart.yaml", None) + dump(meta)
    files["values.yaml"] = header("values.yaml", None) + "".join(f"# {line}\n" for line in values_comments(plan)) + \
        dump(values(plan))
    for name, obj in chart_objects(plan).items():
        marked, condition = _marked(name, obj, plan)
        text = template(dump(marked))
        if condition:
            text = f"{{{{- if {condition} }}}}\n{text}{{{{- end }}}}\n"
        files[f"templates/{name}"] = header(name, obj) + text
    return files

