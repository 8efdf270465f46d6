"""The pod's command, started locally: the generated entrypoint's leader serves a one-rank repository (the CPU
stand-in: forge serve's own tritonserver), and the probe paths answer as the manifests expect them to: the
readiness path not 200 while loading and after a model process is killed, 200 when ready; the liveness path 200
while a generation streams. The check runs in a network namespace of its own (the pod's fixed ports)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k8s_helpers import deploy

HERE = Path(__file__).parent


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.heavy
@pytest.mark.skipif(not _can_unshare(), reason="unshare -n (a network namespace) is not permitted here")
def test_the_entrypoint_serves_and_the_probe_paths_answer(repos, tmp_path):
    out = tmp_path / "k8s"
    assert deploy(repos["tp1"], out) == 0
    container = yaml.safe_load((out / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    script = tmp_path / "entrypoint.sh"
    script.write_text(yaml.safe_load((out / "configmap-entrypoint.yaml").read_text())["data"]["entrypoint.sh"])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["unshare", "-n", sys.executable, str(HERE / "entrypoint_check.py"), str(script),
                           str(repos["tp1"]), "tensorrt_llm"], capture_output=True, text=True, env=env, timeout=1500)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ready"], report
    assert report["ready_seen"][0] != 200 and report["ready_seen"][-1] == 200  # loading first
    assert report["live"] == 200
    assert report["generation_status"] == 200 and report["during_generation"] == [200, 200], report
    assert report["stubs"] >= 1 and report["not_ready_after_kill"], report  # out of the Service at once
    assert report["ready_again"], report  # forge serve restarted it; the pod was not restarted
    assert report["exit"] == 0, report  # SIGTERM: forge serve drains and stops
