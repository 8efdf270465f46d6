"""forge deploy: write what launches a repository elsewhere: a Slurm batch script, docker compose, a shell script."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import UsageError

HELP = "write a launch artifact for a repository: Slurm sbatch script, docker compose file or shell script"

KINDS = {"slurm": "an sbatch script: srun --mpi=pmix, one task per rank, pyxis container",
         "compose": "a docker compose file (JSON, which compose reads as YAML) running the NGC container",
         "shell": "a bash script for one machine: docker run of the container, or mpirun with this installation"}
DEFAULT_OUT = {"slurm": "forge-serve.sbatch", "compose": "compose.yaml", "shell": "forge-serve.sh"}


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, help_text in KINDS.items():
        k = kinds.add_parser(kind, help=help_text, description=help_text)
        k.add_argument("repo", type=Path, metavar="REPO", help="model repository")
        k.add_argument("--out", type=Path, default=None,
                       help=f"file to write (default {DEFAULT_OUT[kind]} in the current directory; - for stdout)")
        k.add_argument("--container-image", default=None, metavar="IMAGE",
                       help="container (default: the NGC tritonserver container of the repository's backend "
                            "profile)" + ("" if kind == "compose" else "; none: this machine's forge installation"))
        k.add_argument("--backend-version", default=None, metavar="X",
                       help="take the container of this backend profile (default: the repository's)")
        k.add_argument("--host", default="0.0.0.0", help="address rank 0 binds (default 0.0.0.0)")
        k.add_argument("--http-port", type=_port, default=8000)
        k.add_argument("--grpc-port", type=_port, default=8001)
        k.add_argument("--metrics-port", type=_port, default=8002)
        k.add_argument("--rendezvous-port", type=_port, default=None,
                       help="where a tensor-parallel python model's ranks meet rank 0 (default 29500)")
        if kind == "slurm":
            k.add_argument("--nodes", type=int, default=1, help="nodes (default 1); ranks are spread evenly")
            k.add_argument("--gpus-per-node", type=int, default=None,
                           help="GPUs to ask per node (default: one per rank on a node when a model needs GPUs)")
            k.add_argument("--partition", default=None, help="Slurm partition")
            k.add_argument("--time", default=None, dest="time_limit", help="job time limit (sbatch --time)")
            k.add_argument("--job-name", default=None, help="job name (default forge-<repository>)")
            k.add_argument("--output", default=None, help="job log (sbatch --output)")
            k.add_argument("--mpi", default="pmix", help="srun --mpi plugin (default pmix)")
        else:
            k.add_argument("--gpus", default=None, help="GPUs to pass to the container (all, none, or ids like 0,1; "
                                                         "default all)")
            k.add_argument("--shm-size", default=None, help="container shared memory (default 2g)")


def _refuse_unused(args: argparse.Namespace, world) -> None:
    """Flags the artifact would not use are errors, never silently dropped."""
    from ..deployment import NO_CONTAINER

    if args.container_image == NO_CONTAINER:
        unused = [flag for flag, value in (("--backend-version", args.backend_version),
                                           ("--gpus", getattr(args, "gpus", None)),
                                           ("--shm-size", getattr(args, "shm_size", None))) if value]
        if unused:
            raise UsageError(f"{', '.join(unused)} choose{'s' if len(unused) == 1 else ''} a container; "
                             "--container-image none runs this machine's forge installation",
                             hint=f"drop {', '.join(unused)}, or name a container")
    if args.rendezvous_port is not None and world.follower_dir is None:
        raise UsageError("--rendezvous-port is where a tensor-parallel python model's ranks meet; this repository "
                         "has none (tensorrtllm ranks meet through MPI)", hint="drop --rendezvous-port")


def run(args: argparse.Namespace) -> int:
    from .. import deployment
    from ..server import launch

    launch.check_servable(args.repo)
    world = launch.layout(args.repo)
    if args.kind == "compose" and args.container_image == deployment.NO_CONTAINER:
        raise UsageError("forge deploy compose runs a container; --container-image none has nothing to run",
                         hint="leave --container-image out (the profile's NGC container) or name an image")
    _refuse_unused(args, world)
    rt = deployment.runtime(args.repo, args.container_image, args.backend_version)
    ends = deployment.Endpoints(args.host, args.http_port, args.grpc_port, args.metrics_port,
                            args.rendezvous_port or deployment.Endpoints.rendezvous_port)
    if len({ends.http_port, ends.grpc_port, ends.metrics_port}) < 3:
        raise UsageError("--http-port, --grpc-port and --metrics-port must differ")
    if args.kind == "slurm":
        text = deployment.slurm_script(args.repo, world, rt, ends, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                   partition=args.partition, time_limit=args.time_limit, job_name=args.job_name,
                                   output=args.output, mpi=args.mpi)
    elif args.kind == "compose":
        text = deployment.compose_file(args.repo, world, rt, ends, gpus=args.gpus or "all", shm_size=args.shm_size or "2g")
    else:
        text = deployment.shell_script(args.repo, world, rt, ends, gpus=args.gpus or "all", shm_size=args.shm_size or "2g")
    out = args.out or Path(DEFAULT_OUT[args.kind])
    if str(out) == "-":
        sys.stdout.write(text)
        return 0
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory", hint=f"name a file, e.g. {out / DEFAULT_OUT[args.kind]}")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    out.write_text(text)
    if args.kind != "compose":
        os.chmod(out, 0o755)
    follow = {"slurm": f"sbatch {out}", "compose": f"docker compose -f {out} up", "shell": f"bash {out}"}[args.kind]
    print(f"wrote {out}: {world.world_size} rank(s), {rt.label}; run: {follow}")
    return 0
