"""forge serve: run a real tritonserver on a model repository, in the foreground."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..errors import ToolMissingError, UsageError
from ..server.session import RESTART_WINDOW_S, RESTARTS

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


def run(args: argparse.Namespace) -> int:
    from ..server import launch
    from ..server.session import Session
    from ..server.triton_server import TritonServer

    launch.check_servable(args.repo)
    world = launch.layout(args.repo, args.world_size)
    if args.docker:
        return _docker(args, world)
    if args.run or args.image:
        raise UsageError(f"{'--run' if args.run else '--image'} only goes with --docker")
    launch.check_llmapi_runtime(world)
    from ..server.vllm_runtime import check_runtime

    check_runtime(args.repo)
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
    openai = None if args.no_openai else {"host": args.host, "port": args.openai_port,
                                          "served_model_name": args.served_model_name, "api_key": api_key}
    session = Session(server, restart=args.restart, drain_timeout=args.drain_timeout, openai=openai)
    return session.run(lambda info: _print_ready(args, info, api_key))


def _print_ready(args: argparse.Namespace, info: dict, api_key: str | None) -> None:
    from ..ui import emit_json

    if args.json:
        emit_json(info)
    else:
        print(f"serving {args.repo} ({len(info['models'])} models READY: {', '.join(info['models'])})")
        print(f"  HTTP     {info['http']}   (POST /v2/models/<model>/generate)")
        print(f"  gRPC     {info['grpc']}")
        print(f"  metrics  {info['metrics']}")
        if "openai" in info:
            print(f"  OpenAI   {info['openai']}   (models: {', '.join(info['openai_models'])})")
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
