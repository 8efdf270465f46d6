"""What ``forge deploy k8s`` deploys: the flags checked once, and what follows from them and the repository.

A :class:`Plan` is plain data the object builders read: how many pods a group has (the repository's GPUs over
``--gpus-per-node``), how its ranks are wired across them, where the repository sits in the pod, the image,
the probes' startup budget and the ``/dev/shm`` size. Every refusal happens here, before anything is written.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__, tritonconfig
from ..errors import UsageError
from ..server import launch

DEFAULT_GPUS_PER_NODE = 8
MODEL_SOURCES = ("pvc", "init", "image")
AUTOSCALERS = ("hpa", "keda")
DEFAULT_PVC = "forge-models"
# KServe's storage initializer (its ``initializer-entrypoint SRC DEST``): s3://, gs://, https://, hf://, pvc://
DEFAULT_INIT_IMAGE = "kserve/storage-initializer:v0.20.0"
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
DEFAULT_WAITING_TARGET = 5
DEFAULT_MAX_REPLICAS = 4
DRAIN_TIMEOUT_S = 30  # forge serve's default --drain-timeout
MODELS_DIR = "/models"
KSERVE_MODELS_DIR = "/mnt/models"  # where KServe's storage initializer puts storageUri
# Startup budget: weights are read from a volume at a few hundred MB/s at worst, then every model loads.
STARTUP_BASE_S = 600
STARTUP_PER_GIB_S = 30
# /dev/shm: tritonserver's python backend moves tensors through it and NCCL uses it between a node's ranks;
# 2 GiB is what forge serve --docker and compose give, and larger models get more (15 GiB at 800 GiB).
SHM_BASE_GIB = 2
SHM_GIB_PER_64_GIB = 1

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_URI = re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"`$;&|<>\\]+")


@dataclass(frozen=True)
class Options:
    """The flags of ``forge deploy k8s`` (None: not given)."""

    name: str | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    gpu_resource: str = "nvidia.com/gpu"
    image: str | None = None
    model_source: str = "pvc"
    pvc: str | None = None
    model_uri: str | None = None
    model_image: str | None = None
    init_image: str | None = None
    replicas: int = 1
    autoscale: str | None = None
    max_replicas: int | None = None
    waiting_target: int | None = None
    prometheus_url: str | None = None
    kserve: bool = False
    helm: bool = False
    node_selector: tuple[str, ...] = ()
    shm_size: str | None = None
    namespace: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    api_key_secret: str | None = None

    def flags(self) -> tuple[list[str], list[str]]:
        """(every flag given or defaulted, with its value; the flags left off), for the generated files' comments."""
        valued = [("--name", self.name), ("--gpus-per-node", self.gpus_per_node),
                  ("--gpu-resource", self.gpu_resource), ("--image", self.image),
                  ("--model-source", self.model_source), ("--pvc", self.pvc), ("--model-uri", self.model_uri),
                  ("--model-image", self.model_image), ("--init-image", self.init_image),
                  ("--replicas", self.replicas), ("--autoscale", self.autoscale),
                  ("--max-replicas", self.max_replicas), ("--waiting-target", self.waiting_target),
                  ("--prometheus-url", self.prometheus_url), ("--shm-size", self.shm_size),
                  ("--namespace", self.namespace), ("--served-model-name", self.served_model_name),
                  ("--api-key-secret", self.api_key_secret)]
        on = [f"{flag} {value}" for flag, value in valued if value is not None]
        on += [f"--node-selector {s}" for s in self.node_selector]
        on += [flag for flag, value in (("--kserve", self.kserve), ("--helm", self.helm)) if value]
        off = [flag for flag, value in valued if value is None]
        off += [] if self.node_selector else ["--node-selector"]
        off += [flag for flag, value in (("--kserve", self.kserve), ("--helm", self.helm)) if not value]
        return on, off


@dataclass(frozen=True)
class Plan:
    """What the objects say: derived once from the repository and :class:`Options`."""

    options: Options  # with every default filled in
    repo: Path
    world: launch.Layout
    nodes: int  # pods of one group (1: a Deployment or KServe, more: a LeaderWorkerSet)
    gpus_per_pod: int  # 0: no GPU asked (a CPU deployment)
    wiring: str  # "one-pod", "followers" (forge serve's mpirun over the group), "llmapi" (trtllm-llmapi-launch)
    repo_path: str  # the repository inside the pod
    size_bytes: int
    startup_budget_s: int
    shm_size: str
    image_recipe_base: str | None  # the NGC container the forge image recipe starts from (None: --image given)
    node_selector: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.options.name  # type: ignore[return-value]

    @property
    def group_ranks(self) -> int:
        """MPI ranks across the group: the repository's world, or the LLM API's tp × pp."""
        return self.world.llmapi_gpus if self.world.llmapi_models else self.world.world_size


def _default_name(repo: Path) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", f"forge-{repo.name}".lower()).strip("-")
    return re.sub(r"-+", "-", name)[:40].rstrip("-")


def check_image(flag: str, image: str) -> None:
    """Refuse an image reference that is not one (it lands in a pod spec and a Dockerfile)."""
    try:
        launch.check_image(image)
    except UsageError:
        raise UsageError(f"{flag} {image!r} is not a container image reference (letters, digits and ._/:@+- only)",
                         hint="name an image like registry.example.com/team/forge:1.0") from None


def _check_name(flag: str, value: str, limit: int = 63) -> None:
    if len(value) > limit or not _DNS_LABEL.fullmatch(value):
        raise UsageError(f"{flag} {value!r} is not a Kubernetes name (lower-case letters, digits and '-', at most "
                         f"{limit} characters, starting and ending with a letter or digit)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _node_selector(pairs: tuple[str, ...]) -> dict[str, str]:
    selector = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value) or len(value) > 63:
            raise UsageError(f"--node-selector {pair!r} is not KEY=VALUE with a Kubernetes label key and value",
                             hint="e.g. --node-selector nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3")
        selector[key] = value
    return selector


def _repository_bytes(repo: Path) -> int:
    return sum(p.stat().st_size for p in repo.rglob("*") if p.is_file() and not p.is_symlink())


def _refuse_local_store(repo: Path) -> None:
    """A retriever reads its Milvus store's URI from the repository; a Milvus Lite file is on this machine only."""
    from ..checks import load_configs

    configs, _, _ = load_configs(repo)
    for name, config in configs.items():
        uri = tritonconfig.parameter(config, "store") or ""
        # forge_store.is_lite's rule (k8s imports nothing of the served code): a path ending in .db, not a URI
        lite = "://" not in uri and uri.rstrip("/").endswith(".db")
        if lite and tritonconfig.parameter(config, "collection"):
            raise UsageError(f"model {name} searches the Milvus Lite file {uri}, which is on this machine and in no "
                             "pod", hint="rebuild with --store http://HOST:19530, a Milvus server the pods reach")


def _refuse_unused(o: Options) -> None:
    """Flags that would change nothing in what is written are errors, never silently dropped."""
    unused = []
    source_flags = {"pvc": ("--pvc", o.pvc), "init": ("--model-uri", o.model_uri),
                    "image": ("--model-image", o.model_image)}
    for source, (flag, value) in source_flags.items():
        if value is not None and o.model_source != source:
            unused.append((flag, f"it goes with --model-source {source}"))
    if o.init_image is not None and o.model_source != "init":
        unused.append(("--init-image", "it goes with --model-source init"))
    if o.autoscale is None:
        for flag, value in (("--max-replicas", o.max_replicas), ("--waiting-target", o.waiting_target)):
            if value is not None:
                unused.append((flag, "it goes with --autoscale hpa|keda"))
    if o.prometheus_url is not None and o.autoscale != "keda":
        unused.append(("--prometheus-url", "it goes with --autoscale keda (an HPA reads prometheus-adapter)"))
    if o.kserve and o.autoscale:
        unused.append((f"--autoscale {o.autoscale}", "KServe scales its InferenceService itself; drop --kserve for "
                       "a Deployment scaled on the queue depth"))
    if o.kserve and o.helm:
        unused.append(("--helm", "the chart holds Deployment or LeaderWorkerSet objects, not KServe's"))
    if unused:
        flag, why = unused[0]
        raise UsageError(f"{flag} does not apply here: {why}", hint=f"drop {flag}")


def make_plan(repo: Path, options: Options) -> Plan:
    """Check the flags against the repository and derive everything the manifests say."""
    o = options
    if o.api_key is not None:
        raise UsageError("forge deploy k8s takes no API key on the command line: it would be written into the "
                         "manifests (and kept in your shell's history)",
                         hint="create a Secret (kubectl create secret generic NAME --from-literal=api-key=KEY) and "
                              "pass --api-key-secret NAME")
    _refuse_unused(o)
    launch.check_servable(repo)
    repo = repo.resolve()
    world = launch.layout(repo)
    _refuse_local_store(repo)
    if world.llm_models:
        raise UsageError(f"model {world.llm_models[0]} runs on the tensorrtllm backend (the engine layout), which only "
                         "the NGC container's own tritonserver serves; the pods run forge serve",
                         hint="use forge deploy compose or slurm for this repository, or rebuild it for the LLM-API "
                              "layout (--backend-version latest)")
    name = o.name or _default_name(repo)
    _check_name("--name", name, 40)
    if o.gpus_per_node < 0:
        raise UsageError(f"--gpus-per-node {o.gpus_per_node}: a count of GPUs, 0 or more")
    ranks = world.llmapi_gpus if world.llmapi_models else world.world_size
    if o.gpus_per_node == 0:
        if world.gpus or world.llmapi_models:
            raise UsageError("--gpus-per-node 0 asks for no GPU, and this repository's models need GPUs",
                             hint=f"use --gpus-per-node {ranks} or more")
        nodes, gpus_per_pod = 1, 0
    elif ranks <= o.gpus_per_node:
        nodes, gpus_per_pod = 1, ranks
    elif ranks % o.gpus_per_node:
        fits = [d for d in _divisors(ranks) if d <= o.gpus_per_node]
        raise UsageError(f"the repository's {ranks} ranks do not fill whole nodes of --gpus-per-node "
                         f"{o.gpus_per_node} (every pod of a group runs as many ranks as it has GPUs)",
                         hint=f"use --gpus-per-node {fits[-1]} ({ranks // fits[-1]} nodes), or one of "
                              f"{', '.join(map(str, fits))}")
    else:
        nodes, gpus_per_pod = ranks // o.gpus_per_node, o.gpus_per_node
    if nodes > 1 and o.kserve:
        raise UsageError(f"--kserve: the repository's {ranks} ranks span {nodes} nodes, and a KServe "
                         "InferenceService here runs one pod per replica",
                         hint="drop --kserve (a LeaderWorkerSet runs the group), or raise --gpus-per-node")
    wiring = "one-pod" if nodes == 1 else ("llmapi" if world.llmapi_models else "followers")
    for flag, image in (("--image", o.image), ("--model-image", o.model_image), ("--init-image", o.init_image)):
        if image is not None:
            check_image(flag, image)
    base = None
    image = o.image
    if image is None:
        base, version = launch.container_image(repo)
        tag = base.rsplit(":", 1)[-1] if ":" in base else "latest"
        image = f"forge-triton:{__version__}-{tag}"
    if o.model_source not in MODEL_SOURCES:
        raise UsageError(f"--model-source {o.model_source}: one of {', '.join(MODEL_SOURCES)}")
    if o.model_source == "init" and o.model_uri is None:
        raise UsageError("--model-source init copies the repository from --model-uri URI (s3://, gs://, https://, "
                         "hf://, pvc://), which is missing")
    if o.model_source == "image" and o.model_image is None:
        raise UsageError("--model-source image mounts an OCI image holding the repository: --model-image IMAGE "
                         "is missing")
    if o.model_uri is not None and not _URI.fullmatch(o.model_uri):
        raise UsageError(f"--model-uri {o.model_uri!r} is not a URI like s3://bucket/path (no spaces or shell "
                         "characters)")
    pvc = o.pvc if o.pvc is not None else (DEFAULT_PVC if o.model_source == "pvc" else None)
    if pvc is not None:
        _check_name("--pvc", pvc, 253)
    if o.api_key_secret is not None:
        _check_name("--api-key-secret", o.api_key_secret, 253)
    if o.namespace is not None:
        _check_name("--namespace", o.namespace)
    if o.replicas < 1:
        raise UsageError(f"--replicas {o.replicas}: at least 1")
    max_replicas = o.max_replicas if o.max_replicas is not None else max(DEFAULT_MAX_REPLICAS, o.replicas)
    if max_replicas < o.replicas:
        raise UsageError(f"--max-replicas {max_replicas} is below --replicas {o.replicas} (the autoscaler's minimum)")
    waiting = o.waiting_target if o.waiting_target is not None else DEFAULT_WAITING_TARGET
    if waiting < 1:
        raise UsageError(f"--waiting-target {waiting}: at least 1 request waiting per replica")
    prometheus = o.prometheus_url or DEFAULT_PROMETHEUS
    if not re.fullmatch(r"https?://[^\s'\"`$;&|<>\\]+", prometheus):
        raise UsageError(f"--prometheus-url {prometheus!r} is not an http(s) URL")
    if not _RESOURCE.fullmatch(o.gpu_resource):
        raise UsageError(f"--gpu-resource {o.gpu_resource!r} is not an extended resource name like nvidia.com/gpu")
    size = _repository_bytes(repo)
    gib = size / 2**30
    shm = o.shm_size or f"{SHM_BASE_GIB + int(gib // 64) * SHM_GIB_PER_64_GIB}Gi"
    if not _QUANTITY.fullmatch(shm):
        raise UsageError(f"--shm-size {shm!r} is not a Kubernetes quantity like 8Gi")
    served = o.served_model_name or repo.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:-]*", served):
        raise UsageError(f"--served-model-name {served!r}: letters, digits and ._/:- only",
                         hint="name the OpenAI model id with --served-model-name")
    filled = Options(name=name, gpus_per_node=o.gpus_per_node, gpu_resource=o.gpu_resource, image=image,
                     model_source=o.model_source, pvc=pvc, model_uri=o.model_uri, model_image=o.model_image,
                     init_image=(o.init_image or DEFAULT_INIT_IMAGE) if o.model_source == "init" else None,
                     replicas=o.replicas, autoscale=o.autoscale,
                     max_replicas=max_replicas if o.autoscale or o.helm else None,
                     waiting_target=waiting if o.autoscale or o.helm else None,
                     prometheus_url=prometheus if o.autoscale == "keda" else None, kserve=o.kserve, helm=o.helm,
                     node_selector=o.node_selector, shm_size=shm, namespace=o.namespace, served_model_name=served,
                     api_key_secret=o.api_key_secret)
    repo_path = KSERVE_MODELS_DIR if o.kserve else f"{MODELS_DIR}/{_safe_dir(repo.name)}"
    return Plan(filled, repo, world, nodes, gpus_per_pod, wiring, repo_path, size,
                STARTUP_BASE_S + math.ceil(gib) * STARTUP_PER_GIB_S, shm, base, _node_selector(o.node_selector))


def _safe_dir(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UsageError(f"the repository's directory name {name!r} cannot be a path in the pod (letters, digits "
                         "and ._- only)", hint="rename or copy the repository")
    return name
