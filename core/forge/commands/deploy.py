"""forge deploy: write what launches a repository elsewhere: a Slurm batch script, docker compose, a shell script,
Kubernetes manifests."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import UsageError

HELP = ("write a launch artifact for a repository: Slurm sbatch script, docker compose file, shell script or "
        "Kubernetes manifests")

KINDS = {"slurm": "an sbatch script: srun --mpi=pmix, one task per rank, pyxis container",
         "compose": "a docker compose file (JSON, which compose reads as YAML) running the NGC container",
         "shell": "a bash script for one machine: docker run of the container, or mpirun with this installation",
         "k8s": "a directory of Kubernetes manifests running forge serve: Deployment + Service on one node, a "
                "LeaderWorkerSet across nodes, or KServe; autoscaling on the queue depth; or a Helm chart"}
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
        if kind == "k8s":
            _k8s_arguments(k)
            continue
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


def _k8s_arguments(k: argparse.ArgumentParser) -> None:
    from ..k8s import plan as k8s

    k.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="directory to write: one YAML file per object and kustomization.yaml (kubectl apply -k DIR), "
                        "or the Helm chart with --helm; a directory forge wrote before is replaced")
    k.add_argument("--name", default=None, help="name of the objects (default forge-<repository directory>)")
    k.add_argument("--gpus-per-node", type=int, default=k8s.DEFAULT_GPUS_PER_NODE, metavar="N",
                   help=f"GPUs of one node (default {k8s.DEFAULT_GPUS_PER_NODE}): a repository of more ranks runs as a "
                        "LeaderWorkerSet of ranks/N pods with N GPUs each, one of N or fewer as a Deployment pod "
                        "with one GPU per rank; 0: no GPU (a CPU build of the python target)")
    k.add_argument("--gpu-resource", default="nvidia.com/gpu", metavar="NAME",
                   help="the extended resource the pods ask for (default nvidia.com/gpu; e.g. a MIG profile)")
    k.add_argument("--image", default=None, metavar="IMAGE",
                   help="the image every pod runs; it needs forge (forge serve) installed (default: "
                        "forge-triton:VERSION-TAG, built from the image/Dockerfile recipe written beside the "
                        "manifests: the repository's NGC tritonserver container with forge)")
    k.add_argument("--model-source", choices=k8s.MODEL_SOURCES, default="pvc",
                   help="where the pods find the repository: pvc (a PersistentVolumeClaim holding it in a directory "
                        "named like the repository; the default), init (an init container copies it from "
                        "--model-uri), image (an OCI image whose files are the repository, --model-image)")
    k.add_argument("--pvc", default=None, metavar="CLAIM",
                   help=f"with --model-source pvc: the claim (default {k8s.DEFAULT_PVC})")
    k.add_argument("--model-uri", default=None, metavar="URI",
                   help="with --model-source init: where to copy the repository from (s3://, gs://, https://, "
                        "hf://, pvc://; KServe's storage initializer)")
    k.add_argument("--init-image", default=None, metavar="IMAGE",
                   help=f"with --model-source init: the copying image (default {k8s.DEFAULT_INIT_IMAGE})")
    k.add_argument("--model-image", default=None, metavar="IMAGE",
                   help="with --model-source image: the OCI image holding the repository (an image volume)")
    k.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="replicas (pods, or groups of pods); with --autoscale the minimum (default 1)")
    k.add_argument("--autoscale", choices=k8s.AUTOSCALERS, default=None,
                   help="scale on the requests waiting per replica (vLLM's vllm:num_requests_waiting from "
                        "forge serve's OpenAI API), with a ServiceMonitor: hpa (a HorizontalPodAutoscaler through "
                        "prometheus-adapter; its rule is written to extras/) or keda (a KEDA ScaledObject)")
    k.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help=f"with --autoscale: at most N replicas (default {k8s.DEFAULT_MAX_REPLICAS})")
    k.add_argument("--waiting-target", type=int, default=None, metavar="N",
                   help=f"with --autoscale: requests waiting per replica to aim at (default "
                        f"{k8s.DEFAULT_WAITING_TARGET})")
    k.add_argument("--prometheus-url", default=None, metavar="URL",
                   help=f"with --autoscale keda: the Prometheus KEDA asks (default {k8s.DEFAULT_PROMETHEUS})")
    k.add_argument("--kserve", action="store_true",
                   help="a KServe ServingRuntime and InferenceService instead (one pod per replica; storageUri from "
                        "--model-source, mounted at /mnt/models)")
    k.add_argument("--helm", action="store_true",
                   help="write a Helm chart instead (values: image, gpusPerPod, replicas, nodeSelector, autoscaling)")
    k.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label every pod needs (repeat for more)")
    k.add_argument("--shm-size", default=None, metavar="QUANTITY",
                   help="the memory-backed /dev/shm of each pod (default 2Gi and 1Gi more per 64 GiB of repository)")
    k.add_argument("--namespace", default=None, help="namespace (kustomization.yaml and the KEDA query; default: "
                                                    "kubectl's)")
    k.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the OpenAI API's model id (default: the repository's directory name)")
    k.add_argument("--api-key-secret", default=None, metavar="SECRET",
                   help="require an API key on the OpenAI API: key 'api-key' of this Secret (kubectl create secret "
                        "generic SECRET --from-literal=api-key=KEY), given to forge serve as FORGE_API_KEY")
    k.add_argument("--api-key", default=None, metavar="KEY",
                   help="refused: a key on the command line would be written into the manifests; use --api-key-secret")


def _k8s(args: argparse.Namespace) -> int:
    from ..k8s import Options, write

    options = Options(name=args.name, gpus_per_node=args.gpus_per_node, gpu_resource=args.gpu_resource,
                      image=args.image, model_source=args.model_source, pvc=args.pvc, model_uri=args.model_uri,
                      model_image=args.model_image, init_image=args.init_image, replicas=args.replicas,
                      autoscale=args.autoscale, max_replicas=args.max_replicas, waiting_target=args.waiting_target,
                      prometheus_url=args.prometheus_url, kserve=args.kserve, helm=args.helm,
                      node_selector=tuple(args.node_selector), shm_size=args.shm_size, namespace=args.namespace,
                      served_model_name=args.served_model_name, api_key=args.api_key,
                      api_key_secret=args.api_key_secret)
    plan, files = write(args.repo, args.out, options)
    what = "a KServe InferenceService" if plan.options.kserve else (
        f"a LeaderWorkerSet of {plan.nodes} pods per replica" if plan.nodes > 1 else "a Deployment")
    apply = f"helm install {plan.name} {args.out}" if plan.options.helm else f"kubectl apply -k {args.out}"
    print(f"wrote {args.out}: {what} ({plan.group_ranks} rank(s), {plan.gpus_per_pod} "
          f"{plan.options.gpu_resource} per pod), image {plan.options.image}; run: {apply}")
    if "image/Dockerfile" in files:
        print(f"  the image: build {args.out / 'image' / 'Dockerfile'} and push it (or pass --image)")
    return 0


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

    if args.kind == "k8s":
        return _k8s(args)
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
