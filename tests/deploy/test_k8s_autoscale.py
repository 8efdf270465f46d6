"""``--autoscale hpa|keda``: scaling on vLLM's ``vllm:num_requests_waiting``, which forge serve's OpenAI API
exports at ``/metrics``, scraped through a ServiceMonitor."""

from __future__ import annotations

import yaml

from k8s_helpers import by_kind, deploy, read_dir


def test_the_metric_scaled_on_is_the_one_forge_serve_exports():
    from forge.k8s.objects import QUEUE_METRIC
    from forge.openai_front.metrics import Metrics

    assert f"\n{QUEUE_METRIC}{{".encode() in Metrics("m").exposition()


def test_hpa_through_prometheus_adapter(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out, "--autoscale", "hpa", "--replicas", 2, "--max-replicas", 6,
                  "--waiting-target", 3) == 0
    kinds = by_kind(read_dir(out))
    hpa, monitor = kinds["HorizontalPodAutoscaler"], kinds["ServiceMonitor"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "forge-tp1"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {"type": "Pods", "pods": {"metric": {"name": "vllm_num_requests_waiting"},
                                               "target": {"type": "AverageValue", "averageValue": "3"}}}
    assert {"port": "openai", "path": "/metrics", "interval": "15s"} in monitor["spec"]["endpoints"]
    # the ServiceMonitor selects the Service (Prometheus then labels each series with its pod)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= kinds["Service"]["metadata"]["labels"].items()
    # prometheus-adapter's rule: vLLM's series (a ':' in its name) as the name the HPA asks for
    rules = yaml.safe_load((out / "extras" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    (rule,) = rules
    assert rule["name"] == {"matches": "^vllm:num_requests_waiting$", "as": "vllm_num_requests_waiting"}
    assert '__name__="vllm:num_requests_waiting"' in rule["seriesQuery"]
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert "extras/prometheus-adapter-values.yaml" not in yaml.safe_load(
        (out / "kustomization.yaml").read_text())["resources"]


def test_keda_on_the_leader_worker_set(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp4"], out, "--gpus-per-node", 2, "--autoscale", "keda", "--namespace", "llm",
                  "--prometheus-url", "http://prometheus.monitoring:9090") == 0
    kinds = by_kind(read_dir(out))
    scaled = kinds["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                                "kind": "LeaderWorkerSet", "name": "forge-tp4"}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"] == {"serverAddress": "http://prometheus.monitoring:9090",
                                   "query": 'sum(vllm:num_requests_waiting{service="forge-tp4",namespace="llm"})',
                                   "threshold": "5"}
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 4)
    assert "ServiceMonitor" in kinds and "HorizontalPodAutoscaler" not in kinds
    assert yaml.safe_load((out / "kustomization.yaml").read_text())["namespace"] == "llm"
