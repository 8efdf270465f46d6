"""The readiness of ``forge deploy``'s artifacts: it says not ready when a python model's process is dead.

tritonserver's ``/v2/health/ready`` keeps answering 200 after a python model's process died (the model
stays READY and its requests never end). The compose healthcheck and the Slurm script's readiness wait
run ``forge.deployment.probe`` instead; here the compose file's healthcheck command, taken from the
parsed YAML, runs against a real tritonserver started the way the artifact starts it (no forge serve,
no supervisor) before and after ``kill -9`` of a model process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from conftest import build
from forge.cli import main


@pytest.fixture(scope="module")
def repo(tiny_gpt2, tmp_path_factory):
    return build(tiny_gpt2, tmp_path_factory.mktemp("deploy") / "repo")


def compose(repo, out, *argv) -> dict:
    assert main(["deploy", "compose", str(repo), "--out", str(out), *map(str, argv)]) == 0
    return yaml.safe_load(out.read_text())  # what docker compose reads


def healthcheck(doc: dict) -> list[str]:
    test = doc["services"]["tritonserver"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    return test[1:]


def test_compose_healthcheck_asks_for_every_python_models_processes(repo, tmp_path):
    doc = compose(repo, tmp_path / "compose.yaml", "--http-port", 9100, "--grpc-port", 9101, "--metrics-port", 9102)
    service = doc["services"]["tritonserver"]
    argv = healthcheck(doc)
    assert argv[:2] == ["python3", "-c"]  # the container's python; forge is not installed there
    code = argv[2]
    assert "/v2/health/ready" in code and "triton_python_backend_stub" in code
    assert f"probe(['http://127.0.0.1:9100', '{repo.resolve()}', 'postprocessing=1', 'preprocessing=1', " \
           "'tensorrt_llm=1'])" in code
    assert "import forge" not in code and "from forge" not in code
    assert service["ports"] == ["9100:9100", "9101:9101", "9102:9102"]
    assert "--http-port=9100" in service["command"]
    assert service["healthcheck"]["interval"] == "10s" and service["healthcheck"]["retries"] == 60


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60)


@pytest.mark.heavy
def test_compose_healthcheck_fails_when_a_model_process_dies_though_triton_says_ready(repo, tmp_path):
    from forge.server.triton_server import TritonServer
    from forge.server.supervisor import stub_processes

    with TritonServer(repo, startup_timeout=600) as server:
        argv = healthcheck(compose(repo, tmp_path / "compose.yaml", "--http-port", server.http_port,
                                   "--grpc-port", server.grpc_port, "--metrics-port", server.metrics_port))
        done = _run(argv)
        assert done.returncode == 0, done.stdout + done.stderr
        stub = next(pid for pid, model in stub_processes(server).items() if model == "tensorrt_llm")
        os.kill(stub, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(pid == stub for pid in stub_processes(server)) and time.monotonic() < deadline:
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as response:
            assert response.status == 200  # the bug the probe is for: Triton still says ready
        done = _run(argv)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "tensorrt_llm (0 of 1)" in done.stdout
    done = _run(argv)  # and nothing answering at all is not ready either
    assert done.returncode == 1 and "is not ready" in done.stdout


@pytest.mark.heavy
def test_shell_script_stops_the_server_when_a_model_process_dies_though_triton_says_ready(repo, tmp_path):
    """``forge deploy shell --container-image none``: ready after the probe; ``kill -9`` of a model process ends
    the script with status 1 and a line naming the model, and nothing of the server is left."""
    from forge.server.processes import describe_process, free_ports, python_stubs, repository_processes

    ports = free_ports(3)
    script = tmp_path / "serve.sh"
    assert main(["deploy", "shell", str(repo), "--container-image", "none", "--host", "127.0.0.1",
                 *(str(a) for a in ("--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2])),
                 "--out", str(script)]) == 0
    log = tmp_path / "serve.log"
    process = subprocess.Popen(["bash", str(script)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "forge: ready:" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        os.kill(python_stubs(repository_processes(repo))["tensorrt_llm"], signal.SIGKILL)
        killed = time.monotonic()
        status = process.wait(60)
        took = time.monotonic() - killed
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    text = log.read_text()
    assert status == 1, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("forge: error:")]
    assert len(errors) == 1 and "tensorrt_llm (0 of 1); stopping the server" in errors[0], text[-3000:]
    assert [describe_process(p) for p in repository_processes(repo)] == []
    print(f"the script exited {took:.1f} s after the kill: {errors[0]}")
