"""``forge deploy slurm|compose|shell``: the artifacts' shape, and bad input refused in one line.

The Slurm script is submitted for real in test_slurm.py; here its text is checked against what
tensorrtllm_backend's multi-node recipe needs (pmix, one task per rank, container and mounts, ports).
"""

from __future__ import annotations

import json

import pytest

from forge.cli import main

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own


def deploy(*argv: str) -> int:
    return main(["deploy", *map(str, argv)])


def test_slurm_script_for_a_tp2_python_repository_in_the_profile_container(repos, tmp_path, capsys):
    from forge import profiles

    repo = repos["gpt-tp2"]
    out = tmp_path / "job.sbatch"
    assert deploy("slurm", repo, "--nodes", 2, "--partition", "gpu", "--time", "01:00:00", "--out", out) == 0
    text = out.read_text()
    image = profiles.resolve(ENGINE).container  # the repository was built for ENGINE
    assert text.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --partition=gpu", "#SBATCH --time=01:00:00", "export MASTER_PORT=29500"):
        assert line in text.splitlines()
    srun = next(l for l in text.splitlines() if l.startswith("srun "))
    assert "--mpi=pmix" in srun and "--ntasks=2" in srun and "--kill-on-bad-exit=1" in srun
    assert f"--container-image={image}" in srun
    assert f"--container-mounts={repo.resolve()}:{repo.resolve()}:ro" in srun
    assert srun.endswith('--multi-prog "$RANKS" &')
    # ready when the script's probe says so (Triton's own ready stays 200 with a dead model process), on the node
    # of rank 0, with the host's python3 (the probe needs no forge)
    wait = next(l for l in text.splitlines() if l.startswith("until "))
    assert wait.startswith('until python3 "$PROBE" "http://$MASTER_ADDR:8000" ')
    assert wait.split('"$PROBE" ')[1].split()[2:5] == ["postprocessing=1", "preprocessing=1", "tensorrt_llm=1"]
    assert "forge: ready: gpt-tp2 on http://$MASTER_ADDR:8000" in text
    probe = text.split("<<'FORGE_PROBE'\n", 1)[1].split("\nFORGE_PROBE\n", 1)[0]
    compile(probe, "probe", "exec")
    assert "import forge" not in probe and "from forge" not in probe
    ranks = text.split("<<'FORGE_RANKS'\n", 1)[1].split("\nFORGE_RANKS\n", 1)[0].splitlines()
    assert ranks[0].startswith("0 /opt/tritonserver/bin/tritonserver ")
    assert "--http-port=8000" in ranks[0] and "--grpc-port=8001" in ranks[0] and "--metrics-port=8002" in ranks[0]
    assert "--backend-config=python,shm-region-prefix-name=forge0_" in ranks[0]
    assert ranks[1] == f"1-1 env PYTHONPATH={repo.resolve()}/tensorrt_llm/1 python3 -m forge_decoder.follower"
    assert "sbatch" in capsys.readouterr().out


def test_slurm_ranks_of_a_tensorrtllm_world_get_their_own_shm_prefix(repos):
    from forge import deployment as d
    from forge.server import launch

    world = launch.Layout(4, ("tensorrt_llm",), True)
    rt = d.Runtime("img", "v1.0.0", "/opt/tritonserver/bin/tritonserver", "python3")
    lines = d.rank_programs(repos["gpt-tp2"], world, rt, d.Endpoints())
    assert [ids for ids, _ in lines] == ["0", "1-3"]
    rest = lines[1][1]
    assert "--backend-config=python,shm-region-prefix-name=forge%t_" in rest
    assert "--model-control-mode=explicit" in rest and "--load-model=tensorrt_llm" in rest
    assert "--allow-http=false" in rest


def test_compose_file_runs_the_profile_container_with_mpirun(repos, tmp_path):
    repo = repos["llama-tp2"]
    out = tmp_path / "compose.yaml"
    assert deploy("compose", repo, "--http-port", 9000, "--grpc-port", 9001, "--metrics-port", 9002,
                  "--gpus", "0,1", "--out", out) == 0
    doc = json.loads(out.read_text())  # JSON is YAML: docker compose reads it as is
    service = doc["services"]["tritonserver"]
    assert service["image"].startswith("nvcr.io/nvidia/tritonserver:")
    assert service["command"][0] == "mpirun" and service["command"].count(":") == 1
    assert "forge_decoder.follower" in service["command"]
    assert service["ports"] == ["9000:9000", "9001:9001", "9002:9002"]
    assert service["volumes"] == [f"{repo.resolve()}:{repo.resolve()}:ro"]
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0", "1"]
    assert doc["x-forge"]["world_size"] == 2
    # healthy means tritonserver ready and each python model's processes alive, not Triton's own ready
    check = service["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python3", "-c"] and "/v2/health/ready" in check[3]
    assert f"'http://127.0.0.1:9000', '{repo.resolve()}', 'postprocessing=1', 'preprocessing=1', " \
           "'tensorrt_llm=1'" in check[3]


def test_shell_script_without_container_uses_this_installation(repos, tmp_path):
    import sys

    out = tmp_path / "serve.sh"
    assert deploy("shell", repos["gpt-tp2"], "--container-image", "none", "--out", out) == 0
    text = out.read_text()
    start = next(line for line in text.splitlines() if line.startswith("setsid mpirun"))
    assert start.startswith("setsid mpirun --allow-run-as-root") and start.endswith(" &")
    assert f"{sys.executable} -m forge_decoder.follower" in start
    # ready when the probe says so, on 127.0.0.1 (the script's machine); a dead model process stops every rank
    wait = next(line for line in text.splitlines() if line.startswith("until "))
    assert wait.startswith(f'until {sys.executable} "$PROBE" "http://127.0.0.1:8000" ')
    assert "forge: ready: gpt-tp2 on http://127.0.0.1:8000" in text and "; stopping the server" in text
    assert "trap 'stop_server; exit 143' TERM" in text.splitlines()
    assert out.stat().st_mode & 0o100


@pytest.mark.parametrize("argv, message", [
    (["slurm", "{repo}", "--nodes", "3"], "--nodes 3 is more nodes than the repository's 2 rank(s)"),
    (["slurm", "{repo}", "--nodes", "0"], "--nodes 0: at least one node"),
    (["slurm", "{repo}", "--gpus-per-node", "-1"], "--gpus-per-node -1"),
    (["compose", "{repo}", "--container-image", "none"], "forge deploy compose runs a container"),
    (["shell", "{repo}", "--http-port", "8001"], "--http-port, --grpc-port and --metrics-port must differ"),
    (["slurm", "{repo}", "--http-port", "70000"], "70000 is not a TCP port"),
    (["slurm", "{repo}", "--out", "/nonexistent/dir/job.sbatch"], "directory /nonexistent/dir does not exist"),
    (["slurm", "/nonexistent/repo"], "/nonexistent/repo is not a directory"),
    (["mesos", "{repo}"], "invalid choice: 'mesos'"),
    (["shell", "{repo}", "--container-image", "none", "--gpus", "0"], "--gpus chooses a container"),
    (["slurm", "{repo}", "--container-image", "none", "--backend-version", "v0.13.0"],
     "--backend-version chooses a container"),
])
def test_bad_input_is_one_line_and_exit_2(repos, capsys, argv, message):
    argv = [a.replace("{repo}", str(repos["gpt-tp2"])) for a in argv]
    assert main(["deploy", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("extra, message", [
    (["--pp", "2"], "--target python runs tensor parallel only"),
    (["--tp", "2", "--instances", "2"], "runs one model instance"),
    (["--tp", "3"], "cannot be split over --tp 3"),
    (["--tp", "2", "--lora", "a={tmp}"], "--target python at --tp 2 serves no LoRA adapters"),
])
def test_python_target_parallelism_it_cannot_run_is_refused(models, tmp_path, capsys, extra, message):
    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models["gpt"]), "--target", "python",
            "--out", str(tmp_path / "repo"), *(a.replace("{tmp}", str(tmp_path)) for a in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not (tmp_path / "repo").exists()


@pytest.mark.heavy
def test_a_tp2_repository_started_outside_a_launch_fails_in_one_line(repos, tmp_path):
    """tritonserver alone (no mpirun): the model refuses to load with the reason, no hang."""
    from forge.errors import ForgeError
    from forge.server.triton_server import TritonServer

    with pytest.raises(ForgeError) as info:
        TritonServer(repos["gpt-tp2"], startup_timeout=300).start()
    assert "tensor parallel over 2 ranks but was started in a world of 1" in str(info.value)


def test_serve_refuses_a_world_size_the_repository_was_not_built_for(repos, capsys):
    assert main(["serve", str(repos["gpt-tp2"]), "--world-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--world-size 3 disagrees with the repository, which was built for 2 rank(s)" in err[0]
