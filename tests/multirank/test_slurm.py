"""``forge deploy slurm``'s script submitted to a real one-node Slurm cluster (slurmctld, slurmd, munged).

The fixture starts the cluster in a temporary directory (slurmcluster.py); the test writes the script
for the tp 2 GPT-2 repository with ``--container-image none`` (this machine's forge installation, as
a cluster whose nodes share it would run), submits it with sbatch, waits for the script's own "forge: ready"
line, sends the seed's curl body, expects the tp 1 answer, cancels the job and checks that no rank is left.
A second job serves the tp 1 build: after ``kill -9`` of its model process tritonserver still says ready,
the script's probe does not, and the script ends the job, leaving nothing.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import PROMPTS, SYSTEM_PACKAGES, ask, leftovers
from forge.cli import main


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from slurmcluster import SlurmCluster, missing

    absent = missing()
    if absent:
        pytest.skip(f"Slurm is not installed ({', '.join(absent)} missing); {SYSTEM_PACKAGES} installs it")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _log(output) -> str:
    return output.read_text() if output.exists() else ""


def _stub(repo, model: str) -> int | None:
    """The pid of ``model``'s python process (rank 0's) serving ``repo``."""
    from forge.server.processes import cmdline

    for entry in os.listdir("/proc"):
        args = cmdline(int(entry)) if entry.isdigit() else []
        if len(args) > 1 and args[0].endswith("triton_python_backend_stub") and \
                args[1].startswith(f"{repo.resolve()}/{model}/"):
            return int(entry)
    return None


def _submit(slurm, repo, tmp_path):
    """``forge deploy slurm --container-image none`` of ``repo`` on free ports, submitted: (job, log, HTTP)."""
    from forge.server.processes import free_ports

    http_port, grpc_port, metrics_port, rendezvous = free_ports(4)
    script = tmp_path / "serve.sbatch"
    extra = ["--rendezvous-port", str(rendezvous)] if repo.name.endswith("tp2") else []
    assert main(["deploy", "slurm", str(repo), "--container-image", "none", "--host", "127.0.0.1",
                 "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                 *extra, "--out", str(script)]) == 0
    output = tmp_path / "job.out"
    job = slurm.submit(script, output)
    deadline = time.monotonic() + 600
    while "forge: ready:" not in _log(output):  # the script's readiness wait, not Triton's own ready
        state = slurm.job_state(job)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job} is {state}: {_log(output)[-3000:]}"
        assert time.monotonic() < deadline, f"not ready: {_log(output)[-3000:]}"
        time.sleep(1)
    assert slurm.job_state(job) == "RUNNING"
    return job, output, f"127.0.0.1:{http_port}"


def _gone(slurm, job, repo) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (slurm.job_state(job) != "GONE" or slurm.job_pids(job) or leftovers(repo)):
        time.sleep(1)
    assert slurm.job_state(job) == "GONE"
    assert slurm.job_pids(job) == [] and leftovers(repo) == []


@pytest.mark.heavy
def test_sbatch_of_a_tp2_repository_answers_like_tp1_and_scancel_leaves_nothing(slurm, repos, reference, tmp_path):
    repo = repos["gpt-tp2"]
    job, output, http = _submit(slurm, repo, tmp_path)
    try:
        assert ask(http, "ensemble", PROMPTS[0]) == reference["gpt"][PROMPTS[0]]
        log = output.read_text()
        assert "forge follower rank 1/2" in log and "tp 2" in log
    finally:
        slurm.run("scancel", job, check=False)
    _gone(slurm, job, repo)


@pytest.mark.heavy
def test_sbatch_script_ends_the_job_when_a_model_process_dies_though_triton_says_ready(slurm, repos, tmp_path):
    repo = repos["gpt-tp1"]
    job, output, http = _submit(slurm, repo, tmp_path)
    try:
        os.kill(_stub(repo, "gpt_tensorrt_llm"), signal.SIGKILL)  # tritonserver goes on answering ready
        deadline = time.monotonic() + 60
        while slurm.job_state(job) == "RUNNING" and time.monotonic() < deadline:
            time.sleep(1)
        assert slurm.job_state(job) != "RUNNING", f"the job goes on: {_log(output)[-3000:]}"
        assert "gpt_tensorrt_llm (0 of 1); ending the job" in _log(output)
    finally:
        slurm.run("scancel", job, check=False)
    _gone(slurm, job, repo)
