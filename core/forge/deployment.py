"""Launch artifacts for a repository: a Slurm batch script, a docker compose file, a shell script.

Each says the same thing as ``forge serve`` (launch.py): how many ranks the repository needs, what
rank 0 and the other ranks run, which NGC container of the profile table serves it. The Slurm
script follows tensorrtllm_backend's multi-node recipe: ``srun --mpi=pmix`` with one task per rank
(``--multi-prog``: rank 0 tritonserver, the others their engine shard or a python model's follower),
pyxis ``--container-image``/``--container-mounts``, a per-rank python-backend shm prefix, fixed ports.
``container="none"`` runs this machine's forge installation instead of a container (a cluster whose
nodes share this environment, or the test's one-node Slurm).

Readiness: tritonserver's ``/v2/health/ready`` answers 200 while a python model's process is dead
(tritonserver 2.51 keeps the model READY), so the compose healthcheck and the Slurm script's wait run
:func:`probe` instead: ready only when tritonserver is and every python model has its processes, the
rule ``forge serve``'s supervisor acts on. The artifacts run tritonserver itself, not ``forge serve``
(the NGC container has no forge), so there is no OpenAI API and no ``/health/ready`` to ask.
"""

from __future__ import annotations

import inspect
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .server import launch

NO_CONTAINER = "none"


@dataclass(frozen=True)
class Endpoints:
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    rendezvous_port: int = 29500  # where a python model's followers meet rank 0


@dataclass(frozen=True)
class Runtime:
    """What runs the ranks: the container's tritonserver and python3, or this machine's installation."""

    image: str | None  # None: no container
    version: str
    tritonserver: str
    python: str
    backend_directory: str | None = None
    environment: tuple[tuple[str, str], ...] = ()  # exported before the ranks start

    @property
    def label(self) -> str:
        return self.image or f"this machine's forge installation ({sys.prefix})"


def runtime(repo: Path, container: str | None, backend_version: str | None = None) -> Runtime:
    """The profile's NGC container (or ``container``), or this installation for ``none``."""
    if container == NO_CONTAINER:
        from .server.install import backend_directory, server_environment, tritonserver_binary

        env = server_environment()
        return Runtime(None, "", str(tritonserver_binary()), sys.executable, str(backend_directory()),
                       (("PATH", env["PATH"]), ("LD_LIBRARY_PATH", env["LD_LIBRARY_PATH"])))
    if container:
        return Runtime(container, backend_version or launch.backend_version(repo) or "",
                       "/opt/tritonserver/bin/tritonserver", "python3")
    image, version = launch.container_image(repo, backend_version)
    return Runtime(image, version, "/opt/tritonserver/bin/tritonserver", "python3")


def probe(argv: "list[str]") -> int:  # a string: the copy may run on an older python3
    """0: tritonserver at ``argv[0]`` is ready and each ``MODEL=N`` of repository ``argv[1]`` has N processes.

    1: tritonserver does not answer ready; 2: a python model has fewer live processes than it needs (it
    died, or has not started yet). The reason goes to stdout. It runs where forge is not installed (the
    container, a Slurm node): the standard library only, its source copied into the artifact.
    """
    import os
    import urllib.request

    url, repo, wanted = argv[0], argv[1].rstrip("/") + "/", dict(a.rsplit("=", 1) for a in argv[2:])
    try:
        with urllib.request.urlopen(url + "/v2/health/ready", timeout=5) as response:
            if response.status != 200:
                print(f"tritonserver at {url} is not ready ({response.status})")
                return 1
    except OSError as exc:
        print(f"tritonserver at {url} is not ready: {getattr(exc, 'reason', exc)}")
        return 1
    alive = dict.fromkeys(wanted, 0)
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        if stat[stat.rfind(")") + 2:].startswith("Z") or len(args) < 2:
            continue  # a zombie serves nothing
        # a python model's process: triton_python_backend_stub <repo>/<model>/<version>/model.py …
        if os.path.basename(args[0]) == "triton_python_backend_stub" and args[1].startswith(repo):
            model = args[1][len(repo):].split("/")[0]
            if model in alive:
                alive[model] += 1
    short = [f"{m} ({alive[m]} of {n})" for m, n in wanted.items() if alive[m] < int(n)]
    if short:
        print(f"tritonserver answers ready, but these python models lack their processes: {', '.join(short)}")
        return 2
    print("ready")
    return 0


def probe_argv(python: str, url: str, repo: Path) -> list[str]:
    """A command running :func:`probe` (its source inlined) for ``repo``'s tritonserver at ``url``."""
    args = [url, str(repo.resolve()), *(f"{m}={n}" for m, n in launch.python_processes(repo).items())]
    code = inspect.getsource(probe) + f"\nraise SystemExit(probe({args!r}))\n"
    return [python, "-c", code]


def _check_paths(*paths: Path) -> None:
    for path in paths:
        if any(c.isspace() for c in str(path)):
            raise UsageError(f"{path} contains whitespace; Slurm's --multi-prog file cannot carry it",
                             hint="move the repository to a path without spaces")


def rank_programs(repo: Path, world: launch.Layout, rt: Runtime, ends: Endpoints,
                  shm_prefix: str = "forge") -> list[tuple[str, list[str]]]:
    """(task ids, argv) lines of an ``srun --multi-prog`` file: rank 0, then the other ranks."""
    first = [rt.tritonserver, *launch.tritonserver_args(
        repo, rank=0, world=world, host=ends.host, http_port=ends.http_port, grpc_port=ends.grpc_port,
        metrics_port=ends.metrics_port, shm_prefix=shm_prefix)]
    if rt.backend_directory:
        first.append(f"--backend-directory={rt.backend_directory}")
    lines = [("0", first)]
    if world.world_size == 1:
        return lines
    others = f"1-{world.world_size - 1}"
    if world.follower_dir is not None:
        lines.append((others, launch.follower_command(world, rt.python)))
    else:
        rest = [rt.tritonserver, *launch.tritonserver_args(
            repo, rank=1, world=world, host=ends.host, http_port=ends.http_port, grpc_port=ends.grpc_port,
            metrics_port=ends.metrics_port, shm_prefix=shm_prefix)]
        rest[-1] = f"--backend-config=python,shm-region-prefix-name={shm_prefix}%t_"  # srun: %t is the rank
        if rt.backend_directory:
            rest.append(f"--backend-directory={rt.backend_directory}")
        lines.append((others, rest))
    return lines


def _probe_file(also: str = "") -> list[str]:
    """Script lines writing :func:`probe`'s source to a temporary ``$PROBE`` (removed on exit, with ``also``)."""
    return ['PROBE="$(mktemp "${TMPDIR:-/tmp}/forge-probe.XXXXXX")"',
            f"trap 'rm -f {also}\"$PROBE\" \"$PROBE.out\"' EXIT",
            "# the readiness probe (forge.deployment.probe): tritonserver's /v2/health/ready stays 200 when a",
            "# python model's process died; this also asks that every python model has its processes",
            "cat > \"$PROBE\" <<'FORGE_PROBE'", "import sys", "", inspect.getsource(probe).rstrip(), "",
            "raise SystemExit(probe(sys.argv[1:]))", "FORGE_PROBE"]


def _readiness(repo: Path, world: launch.Layout, rt: Runtime, ends: Endpoints, address: str, server: str, *,
               ending: str, stop: str, why: str) -> list[str]:
    """Script lines: wait for the probe, say ``forge: ready``, then probe on; a dead model process runs ``stop``.

    ``$server`` is the pid of what serves (srun, mpirun, tritonserver): when it ends the script ends with its status.
    """
    models = " ".join(shlex.quote(f"{m}={n}") for m, n in launch.python_processes(repo).items())
    check = f'{shlex.quote(rt.python)} "$PROBE" "http://{address}:{ends.http_port}" {shlex.quote(str(repo))} {models}'
    alive = f'kill -0 "${server}" 2>/dev/null'
    return [f"until {check.rstrip()} > \"$PROBE.out\"; do",
            f'  {alive} || {{ echo "forge: error: the server ended before it was ready: $(cat "$PROBE.out")"; '
            f"{stop}; exit 1; }}",
            "  sleep 2 & wait $!", "done",
            f'echo "forge: ready: {repo.name} on http://{address}:{ends.http_port} '
            f'(gRPC {address}:{ends.grpc_port}), {world.world_size} rank(s)"',
            f"# tritonserver keeps a dead python model's process dead: {why}",
            f"while {alive}; do",
            f"  status=0; {check.rstrip()} > \"$PROBE.out\" || status=$?",
            '  if [ "$status" = 2 ]; then',
            f'    echo "forge: error: $(cat "$PROBE.out"); {ending}"',
            f"    {stop}; exit 1",
            "  fi", "  sleep 5 & wait $!", "done",
            f'wait "${server}"']


def slurm_script(repo: Path, world: launch.Layout, rt: Runtime, ends: Endpoints, *, nodes: int = 1,
                 gpus_per_node: int | None = None, partition: str | None = None, time_limit: str | None = None,
                 job_name: str | None = None, output: str | None = None, mpi: str = "pmix") -> str:
    """An sbatch script serving ``repo`` with one Slurm task per rank."""
    repo = repo.resolve()
    _check_paths(repo, *([Path(rt.backend_directory)] if rt.backend_directory else []))
    if nodes < 1:
        raise UsageError(f"--nodes {nodes}: at least one node")
    if nodes > world.world_size:
        raise UsageError(f"--nodes {nodes} is more nodes than the repository's {world.world_size} rank(s)",
                         hint=f"use --nodes {world.world_size} or fewer")
    per_node = -(-world.world_size // nodes)
    if world.llmapi_models and nodes > 1:
        raise UsageError(f"the LLM-API model {world.llmapi_models[0]} runs its {world.llmapi_gpus} rank(s) from one "
                         "tritonserver on one node (the LLM API starts its workers itself)",
                         hint="use --nodes 1 with --gpus-per-node "
                              f"{world.llmapi_gpus}; across nodes, start it under trtllm-llmapi-launch")
    # an LLM-API model drives tp × pp GPUs from its one tritonserver process
    gpus = gpus_per_node if gpus_per_node is not None else (
        max(per_node, world.llmapi_gpus) if world.gpus else 0)
    if gpus < 0:
        raise UsageError(f"--gpus-per-node {gpus}: a count of GPUs, 0 or more")
    if world.llmapi_models and gpus < world.llmapi_gpus:
        raise UsageError(f"the LLM-API model {world.llmapi_models[0]} needs {world.llmapi_gpus} GPUs (tp × pp); "
                         f"--gpus-per-node {gpus} gives fewer", hint=f"use --gpus-per-node {world.llmapi_gpus}")
    if world.gpus and gpus * nodes < world.world_size:
        raise UsageError(f"{world.world_size} ranks need one GPU each; --nodes {nodes} × --gpus-per-node {gpus} "
                         f"gives {gpus * nodes}", hint=f"use --gpus-per-node {per_node}")
    name = job_name or f"forge-{repo.name}"
    header = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}",
              f"#SBATCH --ntasks={world.world_size}", f"#SBATCH --ntasks-per-node={per_node}"]
    if gpus:
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    if partition:
        header.append(f"#SBATCH --partition={partition}")
    if time_limit:
        header.append(f"#SBATCH --time={time_limit}")
    if output:
        header.append(f"#SBATCH --output={output}")
    what = "follower" if world.follower_dir is not None else "tritonserver with its engine shard"
    header += [
        f"# written by forge deploy slurm: {repo}",
        f"# {world.world_size} rank(s): rank 0 tritonserver (HTTP {ends.http_port}, gRPC {ends.grpc_port}, metrics "
        f"{ends.metrics_port})" + (f", ranks 1-{world.world_size - 1} {what}" if world.world_size > 1 else ""),
        f"# runtime: {rt.label}" + (f" (tensorrtllm_backend {rt.version})" if rt.version else ""),
        "set -euo pipefail", ""]
    body = []
    for key, value in rt.environment:
        body.append(f"export {key}={shlex.quote(value)}")
    body += ["# rank 0 runs on the first node; its NodeAddr is how Slurm itself reaches it",
             'FIRST_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             'MASTER_ADDR="$(scontrol show node "$FIRST_NODE" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')"',
             'export MASTER_ADDR="${MASTER_ADDR:-$FIRST_NODE}"',
             f"export MASTER_PORT={ends.rendezvous_port}",
             'RANKS="$(mktemp "${TMPDIR:-/tmp}/forge-ranks.XXXXXX")"',
             *_probe_file('"$RANKS" '),
             "# srun --multi-prog: task ids, then the program of those ranks",
             "cat > \"$RANKS\" <<'FORGE_RANKS'"]
    body += [f"{ids} {shlex.join(argv)}" for ids, argv in rank_programs(repo, world, rt, ends)]
    body.append("FORGE_RANKS")
    srun = ["srun", f"--mpi={mpi}", f"--ntasks={world.world_size}", f"--ntasks-per-node={per_node}",
            "--kill-on-bad-exit=1", "--label"]
    if rt.image:
        srun += [f"--container-image={rt.image}", f"--container-mounts={repo}:{repo}:ro"]
    body += [shlex.join(srun) + ' --multi-prog "$RANKS" &', 'SRUN=$!']
    # this script runs on the first node, rank 0's: the probe sees its processes in /proc
    address = "$MASTER_ADDR" if ends.host in ("0.0.0.0", "::", "") else ends.host
    body += _readiness(repo, world, rt, ends, address, "SRUN", ending="ending the job",
                       stop='kill -TERM "$SRUN" 2>/dev/null || true; wait "$SRUN" || true',
                       why="end the job (requeue or resubmit it)")
    return "\n".join(header + body) + "\n"


def shell_script(repo: Path, world: launch.Layout, rt: Runtime, ends: Endpoints, *, gpus: str = "all",
                 shm_size: str = launch.DEFAULT_SHM_SIZE) -> str:
    """A bash script serving ``repo`` on one machine: ``docker run`` of the container, or mpirun/tritonserver.

    Like the Slurm script it waits for :func:`probe`, says ``forge: ready``, and stops the server and exits 1
    when a python model's process dies; SIGTERM or Ctrl-C stops the server (every rank) before the script ends.
    """
    repo = repo.resolve()
    lines = ["#!/bin/bash", f"# written by forge deploy shell: {repo}, {world.world_size} rank(s)",
             f"# runtime: {rt.label}" + (f" (tensorrtllm_backend {rt.version})" if rt.version else ""),
             "set -euo pipefail"]
    if rt.image:
        argv = launch.docker_command(repo, world, rt.image, host=ends.host, http_port=ends.http_port,
                                     grpc_port=ends.grpc_port, metrics_port=ends.metrics_port, shm_size=shm_size,
                                     gpus=gpus)
        start = ["# docker passes SIGTERM on to the container", shlex.join(argv) + " &"]
    else:
        lines += [f"export {key}={shlex.quote(value)}" for key, value in rt.environment]
        extra = [f"--backend-directory={rt.backend_directory}"] if rt.backend_directory else []
        if world.world_size > 1:
            argv = launch.mpirun_command(rt.tritonserver, repo, world, host=ends.host, http_port=ends.http_port,
                                         grpc_port=ends.grpc_port, metrics_port=ends.metrics_port, extra=extra,
                                         python=rt.python,
                                         options=["--oversubscribe", "--bind-to", "none", "--noprefix"],
                                         rendezvous=("127.0.0.1", ends.rendezvous_port))
        else:
            argv = [rt.tritonserver, *launch.tritonserver_args(
                repo, rank=0, world=world, host=ends.host, http_port=ends.http_port, grpc_port=ends.grpc_port,
                metrics_port=ends.metrics_port, shm_prefix="forge"), *extra]
        # a session of its own: what is left of it (ranks, model processes) after a stop can be found and killed
        start = ["# the server in a session of its own: stop_server ends everything in it",
                 "setsid " + shlex.join(argv) + " &"]
    lines += _probe_file()
    lines += [*start, "SERVER=$!",
              "stop_server() {  # SIGTERM (mpirun passes it to every rank), SIGKILL to what is left after 20 s",
              '  kill -TERM "$SERVER" 2>/dev/null || true',
              '  for _ in $(seq 40); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done',
              *([] if rt.image else ['  pkill -KILL -s "$SERVER" 2>/dev/null || true']),
              '  wait "$SERVER" 2>/dev/null || true',
              "}",
              "trap 'stop_server; exit 143' TERM",
              "trap 'stop_server; exit 130' INT"]
    address = "127.0.0.1" if ends.host in ("0.0.0.0", "::", "") else ends.host
    lines += _readiness(repo, world, rt, ends, address, "SERVER", ending="stopping the server", stop="stop_server",
                        why="stop the server and exit 1 (restart the script, or run forge serve, which restarts it)")
    return "\n".join(lines) + "\n"


def compose_file(repo: Path, world: launch.Layout, rt: Runtime, ends: Endpoints, *, gpus: str = "all",
                 shm_size: str = launch.DEFAULT_SHM_SIZE) -> str:
    """A docker compose file (JSON, which is YAML) running the container's tritonserver on ``repo``."""
    if not rt.image:
        raise UsageError("forge deploy compose runs a container; --container-image none has nothing to run",
                         hint="leave --container-image out (the profile's NGC container) or name an image")
    repo = repo.resolve()
    argv = launch.docker_command(repo, world, rt.image, host=ends.host, http_port=ends.http_port,
                                 grpc_port=ends.grpc_port, metrics_port=ends.metrics_port, shm_size=shm_size,
                                 gpus=gpus)
    command = argv[argv.index(rt.image) + 1:]
    service: dict = {
        "image": rt.image, "command": command, "init": True, "shm_size": shm_size,
        "ulimits": {"memlock": -1, "stack": 67108864},
        "ports": [f"{p}:{p}" for p in (ends.http_port, ends.grpc_port, ends.metrics_port)],
        "volumes": [f"{repo}:{repo}:ro"],
        # healthy: tritonserver ready and every python model's processes alive (probe); runs in the container
        "healthcheck": {"test": ["CMD", *probe_argv("python3", f"http://127.0.0.1:{ends.http_port}", repo)],
                        "interval": "10s", "timeout": "10s", "retries": 60},
    }
    if gpus and gpus != "none":
        device = {"driver": "nvidia", "capabilities": ["gpu"]}
        device.update({"count": "all"} if gpus == "all" else {"device_ids": gpus.split(",")})
        service["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
    document = {"name": re.sub(r"[^a-z0-9_-]", "-", f"forge-{repo.name}".lower()), "services": {"tritonserver": service},
                "x-forge": {"repository": str(repo), "world_size": world.world_size,
                            "backend_version": rt.version}}
    return json.dumps(document, indent=2) + "\n"
