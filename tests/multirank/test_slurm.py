"""``forge deploy slurm``'s script submitted to a real one-node Slurm cluster (slurmctld, slurmd, munged).

The fixture starts the cluster in a temporary directory (slurmcluster.py); the test writes the script
for the tp 2 GPT-2 repository with ``--container-image none`` (this machine's forge installation, as
a cluster whose nodes share it would run), submits it with sbatch, waits for READY, sends the seed's
curl body, expects the tp 1 answer, cancels the job and checks that no rank is left.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

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


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.heavy
def test_sbatch_of_a_tp2_repository_answers_like_tp1_and_scancel_leaves_nothing(slurm, repos, reference, tmp_path):
    from forge.serving.server import free_port

    repo = repos["gpt-tp2"]
    http_port, grpc_port, metrics_port, rendezvous = (free_port() for _ in range(4))
    script = tmp_path / "serve.sbatch"
    assert main(["deploy", "slurm", str(repo), "--container-image", "none", "--host", "127.0.0.1",
                 "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                 "--rendezvous-port", str(rendezvous), "--out", str(script)]) == 0
    output = tmp_path / "job.out"
    job = slurm.submit(script, output)
    http = f"127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 600
        while not _ready(http):
            state = slurm.job_state(job)
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), \
                f"job {job} is {state}: {output.read_text()[-3000:] if output.exists() else ''}"
            assert time.monotonic() < deadline, f"not READY: {output.read_text()[-3000:]}"
            time.sleep(1)
        assert slurm.job_state(job) == "RUNNING"
        assert ask(http, "ensemble", PROMPTS[0]) == reference["gpt"][PROMPTS[0]]
        log = output.read_text()
        assert "forge follower rank 1/2" in log and "tp 2" in log
    finally:
        slurm.run("scancel", job, check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (slurm.job_state(job) != "GONE" or slurm.job_pids(job) or leftovers(repo)):
        time.sleep(1)
    assert slurm.job_state(job) == "GONE"
    assert slurm.job_pids(job) == [] and leftovers(repo) == []
