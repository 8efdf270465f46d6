"""forge serve: run a real tritonserver on a model repository, in the foreground."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from ..errors import ForgeError, ToolMissingError, UsageError

RESTARTS, RESTART_WINDOW_S = 5, 600
START_ATTEMPTS = 3  # tries of each restart's start: one can fail under load (a model process slow to come up)
RANK_GRACE_S = 3.0  # a multi-rank world whose model processes died ends within this when a rank died
HELP = "serve a Triton model repository with a real tritonserver (local, or the NGC container with --docker)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", type=Path, metavar="REPO", help="model repository (forge-built or hand-written)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--http-port", type=int, default=8000, help="default 8000; 0: a free port, printed")
    p.add_argument("--grpc-port", type=int, default=8001, help="default 8001; 0: a free port, printed")
    p.add_argument("--metrics-port", type=int, default=8002, help="default 8002; 0: a free port, printed")
    p.add_argument("--log-file", type=Path, default=None, help="tritonserver log (default: a temporary file)")
    p.add_argument("--world-size", type=int, default=None,
                   help="MPI ranks (default: the engine's tp × pp; a different value is refused)")
    p.add_argument("--docker", action="store_true",
                   help="print the NGC tritonserver container command for this repository's profile")
    p.add_argument("--run", action="store_true", help="with --docker: run the printed command")
    p.add_argument("--backend-version", default=None, metavar="X",
                   help="with --docker: container of this backend profile (default: the repository's)")
    p.add_argument("--image", default=None, metavar="IMAGE",
                   help="with --docker: this tritonserver image instead of the profile's NGC container")
    p.add_argument("--gpus", default="all", help="with --docker: GPUs to pass (all, none, or ids like 0,1)")
    p.add_argument("--shm-size", default="2g", help="with --docker: shared memory size (default 2g)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for READY")
    p.add_argument("--json", action="store_true", help="print the endpoints as json when ready")
    p.add_argument("--restart", choices=("on-failure", "never"), default="on-failure",
                   help="when a model process dies: restart tritonserver (on-failure, the default: at most "
                        f"{RESTARTS} times in {RESTART_WINDOW_S // 60} minutes, then exit non-zero) or exit "
                        "non-zero at once (never)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM or Ctrl-C: take no new requests and let those in flight finish for up to S "
                        "seconds, then stop (default 30; a second signal stops at once)")
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of the OpenAI API (/v1; default 9000; 0: a free port, printed)")
    p.add_argument("--no-openai", action="store_true", help="do not serve the OpenAI API")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the OpenAI API's model id (default: the repository's directory name)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="OpenAI API requests must send 'Authorization: Bearer KEY' (default: $FORGE_API_KEY; "
                        "none: no key asked)")


def _docker(args: argparse.Namespace, world) -> int:
    from ..server import launch

    if args.image is not None:
        launch.check_image(args.image)
        image, version = args.image, args.backend_version or launch.backend_version(args.repo) or "?"
    else:
        image, version = launch.container_image(args.repo, args.backend_version)
    argv = launch.docker_command(args.repo, world, image, host=args.host, http_port=args.http_port,
                                 grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                                 shm_size=args.shm_size, gpus=args.gpus, log_file=args.log_file)
    print(f"# backend {version}, {world.world_size} rank(s)", file=sys.stderr)
    print(shlex.join(argv))
    if not args.run:
        return 0
    import shutil

    if shutil.which("docker") is None:
        raise ToolMissingError("docker is not installed", hint="run the printed command where docker is")
    return subprocess.call(argv)


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop()


class _Restarts:
    """``--restart``: whether one more restart is allowed (at most RESTARTS in RESTART_WINDOW_S), and doing it.

    Two things ask: the supervisor when a model process dies, and ``run`` when the server itself ended (a dead
    rank of a multi-rank world: mpirun stops every rank). ``gave_up`` holds the reason once it stops trying.
    """

    def __init__(self, server, policy: str):
        self.server, self.policy = server, policy
        self.times: list[float] = []
        self.gave_up: list[str] = []

    def attempt(self, what: str) -> bool:
        """Restart after ``what`` (one line: what died); False (and ``gave_up`` set, which ``run`` raises as
        the one error line) when the policy says no."""
        import time

        now = time.monotonic()
        self.times[:] = [t for t in self.times if now - t < RESTART_WINDOW_S]
        if self.policy == "never" or len(self.times) >= RESTARTS:
            why = "--restart never" if self.policy == "never" else (
                f"{RESTARTS} restarts within {RESTART_WINDOW_S // 60} minutes already")
            self.gave_up.append(f"{what}; not restarting ({why})")
            return False
        self.times.append(now)
        print(f"forge: {what}; restarting tritonserver (requests in flight fail, new ones are served once its "
              "models are READY)", file=sys.stderr, flush=True)

        def again(attempt: int, exc: Exception) -> None:
            print(f"forge: tritonserver did not start again ({exc}); trying again ({attempt + 1} of "
                  f"{START_ATTEMPTS})", file=sys.stderr, flush=True)

        try:
            self.server.restart(1.0, attempts=START_ATTEMPTS, on_retry=again)
        except Exception as exc:  # noqa: BLE001 - reported; server.wait() then returns the failure
            self.gave_up.append(f"tritonserver did not start again after {what}: {exc}")
            print(f"forge: {self.gave_up[-1]}", file=sys.stderr, flush=True)
            return False
        print(f"forge: tritonserver is back after {time.monotonic() - now:.1f} s", file=sys.stderr, flush=True)
        return True


def _supervise(server, restarts: _Restarts):
    """A supervisor of ``server``'s model processes: restart it when one dies (while ``restarts`` allows).

    In a multi-rank world a dead rank makes mpirun end every rank, rank 0's model processes with them: when
    the server itself ends within RANK_GRACE_S of their deaths, ``run`` handles that end (naming the rank)."""
    import subprocess

    from ..server.supervisor import Supervisor

    def on_dead(models: list[str]) -> None:
        process = server.process
        if server.world is not None and server.world.world_size > 1 and process is not None:
            try:
                process.wait(RANK_GRACE_S)
                return  # the world ended: run's server.wait() returns and says which rank
            except subprocess.TimeoutExpired:
                pass
        if not restarts.attempt(f"the process of model {', '.join(repr(m) for m in models)} died"):
            server.stop(timeout=5)

    return Supervisor(server, on_dead=on_dead)


def _drain(server, front, supervisor, timeout: float) -> int:
    """Stop gracefully: no new requests, those in flight finish (up to ``timeout`` s), then every process stops.

    The OpenAI API answers new requests 503 (Retry-After) and /health/ready 503 at once; tritonserver
    refuses new HTTP connections (see ``TritonServer.stop_accepting``). When the API's requests (streams
    to their last event) are done and the server's queues empty, or at the deadline, the API stops and
    tritonserver goes on to finish its HTTP requests and unload. 0 after a clean drain, 1 when requests
    were cut.
    """
    import time

    started = time.monotonic()
    deadline = started + timeout
    print(f"forge: draining: no new requests; those in flight have up to {timeout:g} s to finish "
          "(a second signal stops at once)", file=sys.stderr, flush=True)
    if supervisor is not None:
        supervisor.stop()
    if front is not None:
        front.front.draining = True  # the API refuses at once, before tritonserver does
    server.stop_accepting()
    left = front.drain(deadline - time.monotonic()) if front is not None else 0
    quiet = 0  # consecutive polls that found the queues empty
    while not left and quiet < 2:
        count = server.in_flight()
        quiet = quiet + 1 if not count else 0
        if time.monotonic() >= deadline:
            left = count or 0
            break
        time.sleep(0.2)
    if front is not None:
        front.stop()
    server.stop(timeout=max(deadline - time.monotonic(), 0.0) + 15)
    status = server.process.returncode if server.process is not None else 0
    if server.world is not None and server.world.world_size > 1:
        status = 0  # mpirun reports the signal that stopped its ranks as status 1: only cut requests count
    took = time.monotonic() - started
    if left or status:
        why = f"{left} request(s) still in flight after --drain-timeout {timeout:g} s" if left else (
            f"tritonserver exited with status {status}")
        print(f"forge: error: the drain was not clean: {why}; stopped after {took:.1f} s", file=sys.stderr,
              flush=True)
        return 1
    print(f"forge: drained and stopped in {took:.1f} s", file=sys.stderr, flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from ..server import launch
    from ..server.triton_server import TritonServer
    from ..ui import emit_json

    launch.check_servable(args.repo)
    world = launch.layout(args.repo, args.world_size)
    if args.docker:
        return _docker(args, world)
    if args.run or args.image:
        raise UsageError(f"{'--run' if args.run else '--image'} only goes with --docker")
    launch.check_llmapi_runtime(world)
    api_key = args.api_key if args.api_key is not None else (os.environ.get("FORGE_API_KEY") or None)
    if not args.no_openai and not 0 <= args.openai_port <= 65535:
        raise UsageError(f"--openai-port {args.openai_port} is not a port (0-65535)")
    if not args.drain_timeout >= 0:
        raise UsageError(f"--drain-timeout {args.drain_timeout:g} is negative")
    # tritonserver's own wait covers the drain and then its unloading (python models take seconds)
    server = TritonServer(args.repo, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, log_file=args.log_file,
                          startup_timeout=args.startup_timeout, world=world,
                          exit_timeout=int(args.drain_timeout) + 10)
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    front = supervisor = None
    restarts = _Restarts(server, args.restart)
    try:
        server.start()
        supervisor = _supervise(server, restarts).start()
        models = [m for m in server.models() if m.get("state") == "READY"]
        info = {"http": f"http://{server.http_url}", "grpc": server.grpc_url, "metrics": server.metrics_url,
                "log": str(server.log_file), "world_size": world.world_size,
                "models": [m["name"] for m in models]}
        if not args.no_openai:
            from ..openai_front import OpenAIServer

            try:
                front = OpenAIServer(args.repo, server.grpc_url, host=args.host, port=args.openai_port,
                                     served_model_name=args.served_model_name, api_key=api_key).start()
            except UsageError as exc:  # nothing it can serve here: Triton's endpoints still are
                print(f"forge: the OpenAI API is off: {exc}", file=sys.stderr, flush=True)
            else:
                info["openai"] = front.url
                info["openai_models"] = front.catalog.ids()
        if args.json:
            emit_json(info)
        else:
            print(f"serving {args.repo} ({len(models)} models READY: {', '.join(info['models'])})")
            print(f"  HTTP     {info['http']}   (POST /v2/models/<model>/generate)")
            print(f"  gRPC     {info['grpc']}")
            print(f"  metrics  {info['metrics']}")
            if front is not None:
                ids = ", ".join(front.catalog.ids())
                print(f"  OpenAI   {info['openai']}   (models: {ids})")
                if api_key is None:
                    exposed = args.host in ("127.0.0.1", "localhost", "::1")
                    print("           no API key: " + ("only this machine can reach it" if exposed else
                                                       f"anyone who reaches {args.host} can use it "
                                                       "(--api-key or FORGE_API_KEY asks for one)"))
                else:
                    print("           API key required (Authorization: Bearer KEY)")
            print(f"  log      {info['log']}")
            print("press Ctrl-C to stop", flush=True)
        sys.stdout.flush()
        while True:
            server.wait()
            if restarts.gave_up:
                raise ForgeError(restarts.gave_up[0], hint=f"full log: {server.log_file}")
            # ended by itself, not by a model process the supervisor saw die: a rank of a multi-rank world
            # (mpirun then stops every rank) or tritonserver itself
            if server.stopping or not restarts.attempt(server.exit_message()):
                raise ForgeError(restarts.gave_up[0] if restarts.gave_up else server.exit_message(),
                                 hint=f"full log: {server.log_file}")
    except (_Stop, KeyboardInterrupt):
        if server.process is None or server.process.poll() is not None:
            print("stopping tritonserver", file=sys.stderr)
            return 0
        try:
            return _drain(server, front, supervisor, args.drain_timeout)
        except (_Stop, KeyboardInterrupt):
            print("forge: error: stopped at once (a second signal during the drain)", file=sys.stderr, flush=True)
            server.stop(timeout=5)
            return 1
    finally:
        if supervisor is not None:
            supervisor.stop()
        if front is not None:
            front.stop()
        server.stop()
        signal.signal(signal.SIGTERM, previous)
