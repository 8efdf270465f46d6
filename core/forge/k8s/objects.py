"""The Kubernetes objects of a :class:`~forge.k8s.plan.Plan`, as plain dictionaries (one per file).

API versions: apps/v1, v1, autoscaling/v2 and rbac.authorization.k8s.io/v1 (core); LeaderWorkerSet
``leaderworkerset.x-k8s.io/v1`` (kubernetes-sigs/lws), KServe ``serving.kserve.io/v1alpha1`` ServingRuntime and
``v1beta1`` InferenceService, KEDA ``keda.sh/v1alpha1`` ScaledObject, prometheus-operator
``monitoring.coreos.com/v1`` ServiceMonitor.
"""

from __future__ import annotations

from typing import Any

from . import pods
from .plan import Plan

#: vLLM's name for the requests waiting in the queue; forge serve's OpenAI API exports it at /metrics
QUEUE_METRIC = "vllm:num_requests_waiting"
#: the same series under the custom-metrics API: prometheus-adapter's rule renames it (no ':' in its names)
QUEUE_METRIC_ADAPTED = "vllm_num_requests_waiting"
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on the leader


def labels(plan: Plan) -> dict[str, str]:
    return {"app.kubernetes.io/name": plan.name, "app.kubernetes.io/component": "forge-serve",
            "app.kubernetes.io/managed-by": "forge"}


def _meta(plan: Plan, name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "labels": labels(plan), **extra}


def _selector(plan: Plan) -> dict[str, str]:
    return {"app.kubernetes.io/name": plan.name}


def workload_ref(plan: Plan) -> dict[str, str]:
    """What an autoscaler scales: the Deployment, or the LeaderWorkerSet (its scale subresource counts groups)."""
    if plan.nodes > 1:
        return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": plan.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.name}


def entrypoint_configmap(plan: Plan) -> dict[str, Any]:
    data = {"entrypoint.sh": pods.entrypoint_script(plan)}
    if plan.nodes > 1:
        data["kubessh"] = pods.kubessh_script(plan)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(plan, f"{plan.name}-entrypoint"), "data": data}


def deployment(plan: Plan) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(plan, plan.name),
            "spec": {"replicas": plan.options.replicas, "selector": {"matchLabels": _selector(plan)},
                     "template": {"metadata": {"labels": labels(plan)}, "spec": pods.pod_spec(plan, "leader")}}}


def leader_worker_set(plan: Plan) -> dict[str, Any]:
    """One group per replica: the leader pod (rank 0, forge serve) and ``nodes - 1`` workers."""
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": _meta(plan, plan.name), "spec": {
        "replicas": plan.options.replicas,
        # LeaderCreated (not LeaderReady): the leader is ready only once its mpirun has started the workers' ranks
        "startupPolicy": "LeaderCreated",
        "leaderWorkerTemplate": {
            "size": plan.nodes,
            # a dead rank ends the MPI world: the whole group starts again, together
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": {"metadata": {"labels": {**labels(plan), "forge.role": "leader"}},
                               "spec": pods.pod_spec(plan, "leader")},
            "workerTemplate": {"metadata": {"labels": {**labels(plan), "forge.role": "worker"}},
                               "spec": pods.pod_spec(plan, "worker")}}}}


def service(plan: Plan) -> dict[str, Any]:
    """The leaders' ports by name: Triton HTTP, gRPC and metrics, and the OpenAI API (with its /metrics)."""
    selector = _selector(plan)
    if plan.nodes > 1:
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
             for name, port in pods.PORTS.items()]
    for port in ports:
        if port["name"] == "grpc":
            port["appProtocol"] = "grpc"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(plan, plan.name),
            "spec": {"type": "ClusterIP", "selector": selector, "ports": ports}}


def rbac(plan: Plan) -> list[dict[str, Any]]:
    """The leader's kubessh: find the group's pods and ``kubectl exec`` into them, in this namespace only."""
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(plan, plan.name)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(plan, plan.name),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                      {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(plan, plan.name),
               "subjects": [{"kind": "ServiceAccount", "name": plan.name}],
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": plan.name}}
    return [account, role, binding]


def service_monitor(plan: Plan) -> dict[str, Any]:
    """Prometheus scrapes the OpenAI API's /metrics (the queue depth) and Triton's metrics port."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _meta(plan, plan.name),
            "spec": {"selector": {"matchLabels": _selector(plan)},
                     "endpoints": [{"port": "openai", "path": "/metrics", "interval": "15s"},
                                   {"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def horizontal_pod_autoscaler(plan: Plan) -> dict[str, Any]:
    """HPA on the requests waiting per leader pod, read from prometheus-adapter's custom-metrics API."""
    o = plan.options
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(plan, plan.name),
            "spec": {"scaleTargetRef": workload_ref(plan), "minReplicas": o.replicas, "maxReplicas": o.max_replicas,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": QUEUE_METRIC_ADAPTED},
                         "target": {"type": "AverageValue", "averageValue": str(o.waiting_target)}}}]}}


def queue_query(plan: Plan) -> str:
    """PromQL: the requests waiting over this deployment's leader pods (labels the ServiceMonitor's scrape adds)."""
    matchers = [f'service="{plan.name}"']
    if plan.options.namespace:
        matchers.append(f'namespace="{plan.options.namespace}"')
    return f"sum({QUEUE_METRIC}{{{','.join(matchers)}}})"


def scaled_object(plan: Plan) -> dict[str, Any]:
    """KEDA: replicas = ceil(requests waiting / --waiting-target), from Prometheus."""
    o = plan.options
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(plan, plan.name),
            "spec": {"scaleTargetRef": workload_ref(plan), "minReplicaCount": o.replicas,
                     "maxReplicaCount": o.max_replicas,
                     "triggers": [{"type": "prometheus", "metadata": {
                         "serverAddress": o.prometheus_url, "query": queue_query(plan),
                         "threshold": str(o.waiting_target)}}]}}


def adapter_rules() -> dict[str, Any]:
    """prometheus-adapter chart values: the queue metric in the custom-metrics API, per pod (for --autoscale hpa)."""
    return {"rules": {"custom": [{
        "seriesQuery": f'{{__name__="{QUEUE_METRIC}",namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{QUEUE_METRIC}$", "as": QUEUE_METRIC_ADAPTED},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}]}}


MODEL_FORMAT = "forge-triton"


def serving_runtime(plan: Plan) -> dict[str, Any]:
    """KServe: the runtime that serves forge repositories (forge serve on /mnt/models)."""
    vols, _ = pods.volumes(plan, kserve=True)
    spec: dict[str, Any] = {
        "supportedModelFormats": [{"name": MODEL_FORMAT, "version": "1", "autoSelect": True}],
        "multiModel": False,
        "containers": [pods.container(plan, "leader", kserve=True)],
        "volumes": vols}
    if plan.node_selector:
        spec["nodeSelector"] = dict(plan.node_selector)
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntime", "metadata": _meta(plan, plan.name),
            "spec": spec}


def storage_uri(plan: Plan) -> str:
    o = plan.options
    if o.model_source == "pvc":
        return f"pvc://{o.pvc}/{plan.repo.name}"
    if o.model_source == "image":
        return f"oci://{o.model_image}"  # KServe's modelcar
    return o.model_uri  # type: ignore[return-value]


def inference_service(plan: Plan) -> dict[str, Any]:
    """KServe: the repository (storageUri, mounted at /mnt/models) served by the forge runtime."""
    model: dict[str, Any] = {"modelFormat": {"name": MODEL_FORMAT}, "runtime": plan.name,
                             "storageUri": storage_uri(plan)}
    if plan.gpus_per_pod:
        model["resources"] = pods.resources(plan)
    meta = _meta(plan, plan.name, annotations={"serving.kserve.io/deploymentMode": "Standard"})
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": meta,
            "spec": {"predictor": {"minReplicas": plan.options.replicas, "model": model}}}


def build(plan: Plan) -> dict[str, dict[str, Any]]:
    """File name → object, in the order ``kubectl apply`` should meet them."""
    out: dict[str, dict[str, Any]] = {"configmap-entrypoint.yaml": entrypoint_configmap(plan)}
    if plan.options.kserve:
        out["servingruntime.yaml"] = serving_runtime(plan)
        out["inferenceservice.yaml"] = inference_service(plan)
        return out
    if plan.nodes > 1:
        account, role, binding = rbac(plan)
        out.update({"serviceaccount.yaml": account, "role.yaml": role, "rolebinding.yaml": binding,
                    "leaderworkerset.yaml": leader_worker_set(plan)})
    else:
        out["deployment.yaml"] = deployment(plan)
    out["service.yaml"] = service(plan)
    if plan.options.autoscale:
        out["servicemonitor.yaml"] = service_monitor(plan)
        if plan.options.autoscale == "hpa":
            out["horizontalpodautoscaler.yaml"] = horizontal_pod_autoscaler(plan)
        else:
            out["scaledobject.yaml"] = scaled_object(plan)
    return out
