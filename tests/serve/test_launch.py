"""How forge serve launches repositories: checks first, MPI ranks for multi-GPU engines, the NGC container."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from forge import tritonconfig as tc
from forge.cli import main
from forge.errors import EXIT_INVALID, EXIT_TOOL_MISSING, EXIT_USAGE
from forge.server import launch


def engine_repo(root: Path, world: int = 2, manifest: dict | None = None) -> Path:
    """A hand-written repository with a C++ tensorrt_llm model and an engine built for ``world`` ranks."""
    repo = root / "repo"
    model = repo / "tensorrt_llm"
    (model / "1").mkdir(parents=True)
    config = tc.model_config("tensorrt_llm", backend="tensorrtllm", max_batch_size=8,
                             inputs=[tc.model_input("input_ids", "INT32", [-1])],
                             outputs=[tc.model_output("output_ids", "INT32", [-1, -1])],
                             parameters={"gpt_model_path": str((model / "1").resolve())})
    tc.write(config, model)
    (model / "1" / "config.json").write_text(json.dumps(
        {"pretrained_config": {"mapping": {"world_size": world, "tp_size": world, "pp_size": 1}}}))
    for rank in range(world):
        (model / "1" / f"rank{rank}.engine").write_bytes(b"")
    if manifest is not None:
        (repo / launch.MANIFEST).write_text(json.dumps(manifest))
    return repo


def test_world_size_comes_from_the_engine(tmp_path):
    repo = engine_repo(tmp_path, world=2)
    world = launch.layout(repo)
    assert world.world_size == 2 and world.llm_models == ("tensorrt_llm",) and world.gpus


def test_a_world_size_that_disagrees_with_the_engine_is_refused(tmp_path):
    """Bad input: --world-size 4 for an engine built for tp×pp = 2."""
    repo = engine_repo(tmp_path, world=2)
    assert main(["serve", str(repo), "--world-size", "4", "--docker"]) == EXIT_USAGE


def test_mpirun_line_is_one_rank_per_gpu_like_launch_triton_server(tmp_path):
    repo = engine_repo(tmp_path, world=2).resolve()
    argv = launch.mpirun_command("/opt/tritonserver/bin/tritonserver", repo, launch.layout(repo),
                                 http_port=8000, grpc_port=8001, metrics_port=8002)
    assert argv == [
        "mpirun", "--allow-run-as-root",
        "-n", "1", "/opt/tritonserver/bin/tritonserver", f"--model-repository={repo}",
        "--disable-auto-complete-config", "--http-address=127.0.0.1", "--http-port=8000",
        "--grpc-address=127.0.0.1", "--grpc-port=8001", "--metrics-address=127.0.0.1", "--metrics-port=8002",
        "--allow-metrics=true", "--backend-config=python,shm-region-prefix-name=prefix0_",
        ":",
        "-n", "1", "/opt/tritonserver/bin/tritonserver", f"--model-repository={repo}",
        "--disable-auto-complete-config", "--model-control-mode=explicit", "--load-model=tensorrt_llm",
        "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
        "--backend-config=python,shm-region-prefix-name=prefix1_",
    ]


def test_serving_several_ranks_without_mpirun_names_the_command(tmp_path, monkeypatch, capsys):
    """Missing tool: a 2-rank repository where mpirun is not installed."""
    monkeypatch.setattr(launch, "find_mpirun", lambda: None)
    repo = engine_repo(tmp_path, world=2)
    assert main(["serve", str(repo)]) == EXIT_TOOL_MISSING
    err = capsys.readouterr().err
    assert "needs 2 ranks, and mpirun is not installed" in err and "--load-model=tensorrt_llm" in err


def test_docker_command_matches_the_repository_profile(tmp_path, capsys):
    repo = engine_repo(tmp_path, world=1, manifest={"spec": {"backend_version": "v0.13.0"}}).resolve()
    assert main(["serve", str(repo), "--docker"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[:2] == ["docker", "run"] and "--shm-size=2g" in argv and "memlock=-1" in argv
    assert argv[argv.index("--gpus") + 1] == "all"
    assert "127.0.0.1:8000:8000" in argv and "127.0.0.1:8001:8001" in argv
    assert f"{repo}:{repo}:ro" in argv
    assert "nvcr.io/nvidia/tritonserver:24.09-trtllm-python-py3" in argv
    assert argv[argv.index("nvcr.io/nvidia/tritonserver:24.09-trtllm-python-py3") + 1] == "/opt/tritonserver/bin/tritonserver"


def test_docker_command_for_several_ranks_runs_mpirun_inside(tmp_path, capsys):
    repo = engine_repo(tmp_path, world=2)
    assert main(["serve", str(repo), "--docker", "--backend-version", "v0.5.0", "--gpus", "0,1"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    image = "nvcr.io/nvidia/tritonserver:23.10-trtllm-python-py3"
    assert argv[argv.index(image) + 1:argv.index(image) + 3] == ["mpirun", "--allow-run-as-root"]
    assert argv[argv.index("--gpus") + 1] == "device=0,1" and argv.count("-n") == 2


def test_serve_refuses_a_broken_repository_with_its_first_problem(tmp_path, capsys):
    """Bad input: an ensemble that names a model the repository lacks."""
    repo = tmp_path / "repo"
    config = tc.model_config("ensemble", platform="ensemble", max_batch_size=1,
                             inputs=[tc.model_input("x", "INT32", [1])], outputs=[tc.model_output("y", "INT32", [1])])
    step = config.ensemble_scheduling.step.add(model_name="missing", model_version=-1)
    step.input_map["a"] = "x"
    step.output_map["b"] = "y"
    tc.write(config, repo / "ensemble")
    assert main(["serve", str(repo)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith("forge: error: refusing to serve") and "'missing'" in err


def test_serve_refuses_a_missing_directory(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope")]) == EXIT_USAGE


def python_model(model: Path, initialize: str) -> None:
    """A python-backend model at ``model`` (x → y, INT32) whose ``initialize`` runs ``initialize``."""
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        f"        {initialize}\n"
        "    def execute(self, requests):\n"
        "        return []\n")
    tc.write(tc.model_config(model.name, backend="python", inputs=[tc.model_input("x", "INT32", [1])],
                             outputs=[tc.model_output("y", "INT32", [1])]), model)


@pytest.mark.heavy
def test_serve_prints_the_failing_models_own_error(tmp_path, capsys):
    """A model whose initialize raises: forge serve exits 1 with that model's error, not a log dump."""
    repo = tmp_path / "repo"
    python_model(repo / "broken", "raise ValueError('weights file is missing: /nowhere/model.safetensors')")
    assert main(["serve", str(repo), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert "model 'broken': ValueError: weights file is missing: /nowhere/model.safetensors" in err
    assert len(err.splitlines()) == 1


@pytest.mark.heavy
def test_a_restart_whose_start_fails_tries_again(tmp_path):
    """A model whose initialize fails once after a restart (a flag file it removes): ``restart(attempts=2)``
    reports the failed start and comes back READY on the second; with one attempt the failure is raised."""
    from forge.errors import ForgeError
    from forge.server.triton_server import TritonServer

    repo, flag = tmp_path / "repo", tmp_path / "fail-once"
    python_model(repo / "flaky", f"import os\n        if os.path.exists({str(flag)!r}):\n"
                                 f"            os.remove({str(flag)!r})\n            raise RuntimeError('not this time')")
    retries = []
    with TritonServer(repo) as server:
        flag.touch()
        server.restart(1.0, attempts=2, on_retry=lambda attempt, exc: retries.append((attempt, str(exc))))
        assert len(retries) == 1 and retries[0][0] == 1 and "not this time" in retries[0][1]
        assert server.request("/v2/health/ready")[0] == 200
        flag.touch()
        with pytest.raises(ForgeError, match="not this time"):
            server.restart(1.0)
