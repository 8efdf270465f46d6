"""``--helm``: a chart of the same objects, its values wired to the image, GPUs, replicas and autoscaling.

No helm binary installs from PyPI or Debian here, so the chart is rendered by ``helm_render`` (the few template
forms forge writes, nothing else); where ``helm`` is on PATH, ``helm template`` renders it as well.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from helm_render import render
from k8s_helpers import deploy, pods_of, read_dir, validate


def test_chart_with_default_values_is_the_manifests(repos, tmp_path):
    chart, plain = tmp_path / "chart", tmp_path / "plain"
    assert deploy(repos["tp4"], chart, "--gpus-per-node", 2, "--helm", "--node-selector", "pool=gpu") == 0
    assert deploy(repos["tp4"], plain, "--gpus-per-node", 2, "--node-selector", "pool=gpu") == 0
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["name"] == "forge-tp4"
    rendered = {name: obj for name, obj in render(chart).items() if obj is not None}
    assert rendered == read_dir(plain)  # autoscaling and the ServiceMonitor are off by default
    values = yaml.safe_load((chart / "values.yaml").read_text())
    assert values == {"image": rendered["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"][
        "spec"]["containers"][0]["image"], "replicas": 1, "gpusPerPod": 2, "nodeSelector": {"pool": "gpu"},
        "autoscaling": {"enabled": False, "maxReplicas": 4, "waitingTarget": 5}, "serviceMonitor": {"enabled": False}}


def test_values_change_what_renders(repos, tmp_path):
    chart = tmp_path / "chart"
    assert deploy(repos["tp1"], chart, "--helm") == 0
    rendered = render(chart, {"image": "r.io/forge:2", "replicas": 3, "gpusPerPod": 2, "nodeSelector": {"a": "b"},
                              "autoscaling.enabled": True, "autoscaling.maxReplicas": 9,
                              "autoscaling.waitingTarget": 7, "serviceMonitor.enabled": True})
    pod = rendered["deployment.yaml"]["spec"]["template"]["spec"]
    assert rendered["deployment.yaml"]["spec"]["replicas"] == 3
    assert pod["containers"][0]["image"] == "r.io/forge:2"
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["nodeSelector"] == {"a": "b"}
    hpa = rendered["horizontalpodautoscaler.yaml"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 9)
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "7"
    assert rendered["servicemonitor.yaml"]["kind"] == "ServiceMonitor"
    problems = [p for obj in rendered.values() for o in [obj, *pods_of(obj)] for p in validate(o)]
    assert not problems, problems


def test_keda_chart(repos, tmp_path):
    chart = tmp_path / "chart"
    assert deploy(repos["tp1"], chart, "--helm", "--autoscale", "keda", "--max-replicas", 5) == 0
    rendered = render(chart)
    scaled = rendered["scaledobject.yaml"]
    assert scaled["spec"]["maxReplicaCount"] == 5 and scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "5"
    assert "horizontalpodautoscaler.yaml" not in rendered
    assert not render(chart, {"autoscaling.enabled": False})["scaledobject.yaml"]


@pytest.mark.skipif(shutil.which("helm") is None, reason="helm is not installed (not on PyPI or Debian)")
def test_helm_template_renders_the_same(repos, tmp_path):
    chart = tmp_path / "chart"
    assert deploy(repos["tp4"], chart, "--gpus-per-node", 2, "--helm", "--autoscale", "hpa") == 0
    done = subprocess.run(["helm", "template", "forge", str(chart)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    by_helm = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(done.stdout) if d}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in render(chart).values() if o}
    assert by_helm == ours
