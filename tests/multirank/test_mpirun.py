"""``forge serve`` of tensor-parallel python-target repositories: two ranks under Open MPI's mpirun.

Each test runs the real CLI as a subprocess (as a user would), asks the real tritonserver on rank 0
and compares with what the single-rank build answered; then it stops the server (SIGTERM) or kills a
rank, and checks that no rank, stub or follower of the repository is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import PROMPTS, ask, leftovers, need_mpirun
from forge.errors import ForgeError


class Serve:
    """``forge serve REPO --json`` in the background, until it prints its endpoints."""

    def __init__(self, repo: Path, log: Path, *extra: str):
        self.repo = repo
        self.process = subprocess.Popen(  # ports of 0: forge picks them (and picks again if one is taken first)
            [sys.executable, "-m", "forge", "serve", str(repo), "--json", "--log-file", str(log),
             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            text = ""
            while True:  # the endpoints, as one (indented) json document
                line = self.process.stdout.readline()
                if not line:
                    self.process.wait(30)
                    pytest.fail(f"forge serve exited with {self.process.returncode}: {self.process.stderr.read()}")
                text += line
                if line.rstrip() == "}":
                    break
            self.info = json.loads(text)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM (forge stops every rank), SIGKILL only if that hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        return self.process.returncode, self.process.stderr.read()


def follower_pid(repo: Path) -> int:
    """The follower rank of ``repo`` (its PYTHONPATH names the model's directory)."""
    for line in leftovers(repo):
        pid, command = line.split(": ", 1)
        if "-m forge_decoder.follower" in command and not command.startswith(("env ", "/usr/bin/mpirun", "mpirun")):
            return int(pid)
    raise AssertionError(f"no follower rank of {repo} among {leftovers(repo)}")


def wait_gone(repo: Path, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and leftovers(repo):
        time.sleep(0.5)
    return leftovers(repo)


def restarted_then_stopped(server: Serve, answers: dict[str, str]) -> tuple[int, str]:
    """Wait (at most 180 s) until the restarted world answers PROMPTS[0] as ``answers`` has it, then SIGTERM;
    forge serve's (exit status, stderr)."""
    http = server.info["http"].removeprefix("http://")
    deadline = time.monotonic() + 180
    while True:
        assert server.process.poll() is None and time.monotonic() < deadline, "not restarted"
        try:
            assert ask(http, "ensemble", PROMPTS[0]) == answers[PROMPTS[0]]
            break
        except ForgeError:  # a dead rank's error, or not served yet: refused, or failed while the world restarts
            time.sleep(1)
    server.process.send_signal(signal.SIGTERM)
    return server.finish()


def grpc_answer(grpc_url: str, prompt: str) -> str:
    from forge.clients.inference import GrpcSession, generate_payload, text_of

    with GrpcSession(grpc_url) as session:
        inputs = session.config("ensemble")
        payload = generate_payload(inputs, prompt, 20)
        outputs = session.infer("ensemble", {n: inputs.array(n, v) for n, v in payload.items()}, timeout_s=120)
    return text_of(outputs["text_output"])


@pytest.mark.heavy
def test_gpt_tp2_answers_like_tp1_a_dead_follower_restarts_the_world_and_sigterm_stops_every_rank(repos, reference, tmp_path):
    need_mpirun()
    repo = repos["gpt-tp2"]
    server = Serve(repo, tmp_path / "server.log")
    try:
        assert server.info["world_size"] == 2
        http = server.info["http"].removeprefix("http://")
        for prompt in PROMPTS:
            answer = ask(http, "ensemble", prompt)
            assert answer == reference["gpt"][prompt]
            assert answer.startswith(prompt) and len(answer) > len(prompt)
        assert grpc_answer(server.info["grpc"], PROMPTS[0]) == reference["gpt"][PROMPTS[0]]
        assert "tp 2" in (tmp_path / "server.log").read_text()
        # --restart on-failure (the default): a dead follower rank restarts the world, which answers again
        os.kill(follower_pid(repo), signal.SIGKILL)
        status, stderr = restarted_then_stopped(server, reference["gpt"])
    finally:
        server.stop()
    assert status == 0, stderr
    assert "forge: rank 1 (the follower of model 'tensorrt_llm') exited on signal 9" in stderr
    assert "restarting tritonserver" in stderr and "tritonserver is back after" in stderr
    assert wait_gone(repo) == []


@pytest.mark.heavy
def test_llama_tp2_answers_like_tp1_and_under_restart_never_a_dead_rank_stops_the_server_naming_it(repos, reference, tmp_path):
    need_mpirun()
    repo = repos["llama-tp2"]
    server = Serve(repo, tmp_path / "server.log", "--restart", "never")
    try:
        http = server.info["http"].removeprefix("http://")
        for prompt in PROMPTS:
            assert ask(http, "ensemble", prompt) == reference["llama"][prompt]
        # Together, of different lengths: rows join and leave the ranks' shared batch between steps.
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda args: ask(http, "ensemble", args[0], max_tokens=args[1]),
                                    [(PROMPTS[0], 20), (PROMPTS[1], 7), (PROMPTS[0], 3)]))
        assert answers[0] == reference["llama"][PROMPTS[0]]
        for answer, prompt in ((answers[1], PROMPTS[1]), (answers[2], PROMPTS[0])):  # shorter: a prefix
            assert reference["llama"][prompt].startswith(answer) and len(prompt) < len(answer) < len(
                reference["llama"][prompt])
        os.kill(follower_pid(repo), signal.SIGKILL)
        status, stderr = server.finish()
    finally:
        server.stop()
    assert status == 1
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("forge: error: rank 1 (the follower of model 'tensorrt_llm') exited on signal 9")
    assert "; not restarting (--restart never)" in lines[0]
    assert wait_gone(repo) == []


@pytest.mark.heavy
def test_llama_tp2_with_the_engine_in_its_own_process_answers_like_tp1_and_its_death_restarts_the_world(
        models, reference, tmp_path):
    """``-o engine_process=true`` at --tp 2: the engine process, not the stub, leads the follower; answers equal tp 1
    (also together); a SIGKILL of the engine process takes its follower with it and forge serve restarts the world;
    SIGTERM then leaves nothing."""
    from conftest import build

    from forge.server.processes import engine_processes

    need_mpirun()
    repo = build("llama", models["llama"], tmp_path / "llama-tp2-hosted", "--tp", "2", "--max-input-len", "32",
                 "--max-seq-len", "64", "-o", "engine_process=true")
    server = Serve(repo, tmp_path / "server.log")
    try:
        http = server.info["http"].removeprefix("http://")
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda prompt: ask(http, "ensemble", prompt), PROMPTS))
        assert answers == [reference["llama"][prompt] for prompt in PROMPTS]
        log = (tmp_path / "server.log").read_text()
        assert "tp 2" in log and "engine in its own process" in log
        engines = engine_processes([int(line.split(":", 1)[0]) for line in leftovers(repo)])
        assert len(engines) == 1, leftovers(repo)
        os.kill(next(iter(engines)), signal.SIGKILL)
        status, stderr = restarted_then_stopped(server, reference["llama"])  # the old world cannot answer
    finally:
        server.stop()
    assert status == 0, stderr
    assert "forge: rank 1 (the follower of model 'tensorrt_llm') exited" in stderr, stderr
    assert "restarting tritonserver" in stderr
    assert wait_gone(repo) == []


@pytest.mark.heavy
def test_deploy_shell_script_runs_the_ranks_and_sigterm_stops_them(repos, reference, tmp_path):
    """``forge deploy shell --container-image none``: the script itself serves, as written."""
    from forge.cli import main
    from forge.server.processes import free_ports

    need_mpirun()
    repo = repos["gpt-tp2"]
    ports = free_ports(4)
    script = tmp_path / "serve.sh"
    assert main(["deploy", "shell", str(repo), "--container-image", "none", "--host", "127.0.0.1",
                 "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                 "--rendezvous-port", str(ports[3]), "--out", str(script)]) == 0
    log = open(tmp_path / "serve.log", "w")
    process = subprocess.Popen(["bash", str(script)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    http = f"127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not READY"
            try:
                ask(http, "ensemble", PROMPTS[0], max_tokens=1)
                break
            except Exception:
                time.sleep(1)
        assert ask(http, "ensemble", PROMPTS[0]) == reference["gpt"][PROMPTS[0]]
    finally:
        process.send_signal(signal.SIGTERM)  # the script exec'd mpirun: it stops every rank
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    assert wait_gone(repo) == [], (tmp_path / "serve.log").read_text()[-2000:]


@pytest.mark.heavy
@pytest.mark.parametrize("family, ranks, decoder", [("llama", 4, "hf"), ("llama", 4, "static"), ("llama", 2, "paged"),
                                                    ("llama", 2, "compiled"), ("gpt", 2, "static"),
                                                    ("llama", 2, "overlapped")])
def test_engine_at_tp4_generates_the_tp1_ids(models, family, ranks, decoder):
    """Ranks on the engine alone (no server): the 2 KV heads of the tiny Llama are copied over 4 ranks; the
    tensor-parallel engine decodes through the Hugging Face forward or the CUDA-graph decoder (eager on a
    CPU: the arithmetic and the commands a captured step replays, all-reduces inside the layers), static or
    paged, its layers eager or through torch.compile's tracing (the all-reduces between the compiled pieces), or
    with overlapped steps (the followers gather their tokens from their own picks)."""
    import forge.in_triton as served
    from forge.server.processes import free_port

    need_mpirun()
    result = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--noprefix", "-n", str(ranks),
         "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}", sys.executable,
         str(Path(__file__).parent / "engine_ranks.py"), str(served.DECODER_RUNTIME.parent), str(models[family]),
         decoder],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EQUAL" in result.stdout.splitlines(), result.stdout[-3000:]


def rank0_pid(repo: Path) -> int:
    """Rank 0's tritonserver of ``repo``."""
    for line in leftovers(repo):
        pid, command = line.split(": ", 1)
        if Path(command.split(" ", 1)[0]).name == "tritonserver":
            return int(pid)
    raise AssertionError(f"no tritonserver rank of {repo} among {leftovers(repo)}")


@pytest.mark.heavy
def test_a_killed_rank_0_leaves_nothing_and_the_repository_serves_again(repos, reference, tmp_path):
    """kill -9 of rank 0's tritonserver under --restart never: forge serve exits non-zero, no process of the world
    is left within 15 s (mpirun, the follower, stubs), and a new server on the same repository starts and answers.
    (With the default --restart on-failure the world is restarted instead.)"""
    need_mpirun()
    repo = repos["gpt-tp2"]
    server = Serve(repo, tmp_path / "server.log", "--restart", "never")
    try:
        http = server.info["http"].removeprefix("http://")
        assert ask(http, "ensemble", PROMPTS[0]) == reference["gpt"][PROMPTS[0]]
        os.kill(rank0_pid(repo), signal.SIGKILL)
        status, stderr = server.finish()
    finally:
        server.stop()
    assert status == 1 and "Traceback" not in stderr, stderr
    assert wait_gone(repo, timeout=15) == []
    again = Serve(repo, tmp_path / "again.log")
    try:
        assert ask(again.info["http"].removeprefix("http://"), "ensemble", PROMPTS[0]) == reference["gpt"][PROMPTS[0]]
    finally:
        again.stop()
    assert wait_gone(repo) == []
