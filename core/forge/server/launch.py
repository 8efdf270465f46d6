"""How a repository is launched: its world size, the mpirun line for several ranks, the NGC container.

Multi-GPU TensorRT-LLM repositories run one tritonserver per rank under MPI, the way
tensorrtllm_backend's ``launch_triton_server.py`` does it: rank 0 serves every model, the other ranks
load only the tensorrt_llm models (explicit model control, no HTTP/gRPC/metrics endpoints), and each
rank gets its own python-backend shared-memory prefix. A tensor-parallel ``--target python`` model
(its ``tensor_parallel`` parameter > 1) runs the same way, except that ranks > 0 are its followers
(``python -m forge_decoder.follower``, shipped in the model directory), which meet rank 0 at
``MASTER_ADDR``/``MASTER_PORT``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import tritonconfig
from ..errors import ForgeError, ToolMissingError, UsageError, ValidationError

MANIFEST = "forge-manifest.json"
DEFAULT_SHM_SIZE = "2g"


@dataclass(frozen=True)
class Layout:
    """What the repository needs to run: ranks, and the models every rank loads."""

    world_size: int
    llm_models: tuple[str, ...]  # backend tensorrtllm models (loaded on every rank)
    gpus: bool  # whether any model needs a GPU (tensorrtllm backend or KIND_GPU instances)
    # A tensor-parallel python-target model: ranks > 0 run its follower (forge_decoder.follower) instead of
    # tritonserver; this is its version directory (the follower's PYTHONPATH).
    follower_dir: Path | None = None
    # LLM-API models of the tensorrtllm target: TensorRT-LLM's LLM API runs them (one tritonserver; the LLM API
    # starts its own rank workers for tp × pp)
    llmapi_models: tuple[str, ...] = ()
    llmapi_gpus: int = 0  # the GPUs those models drive (tensor × pipeline parallel of their model.yaml)

    @property
    def follower_model(self) -> str | None:
        return self.follower_dir.parent.name if self.follower_dir is not None else None


def _engine_world(config, model_dir: Path) -> int | None:
    raw = tritonconfig.parameter(config, "gpt_model_path") or tritonconfig.parameter(config, "engine_dir")
    candidates = []
    if raw and "${" not in raw:
        path = Path(raw)
        candidates.append(path if path.is_absolute() else model_dir / path)
    candidates.append(model_dir / "1")
    for engine in candidates:
        file = engine / "config.json"
        if file.is_file():
            try:
                data = json.loads(file.read_text())
            except ValueError as exc:
                raise ValidationError(f"{file}: invalid json: {exc}") from None
            mapping = data.get("pretrained_config", {}).get("mapping") or {}
            builder = data.get("builder_config", {})
            tp = mapping.get("tp_size", builder.get("tensor_parallel", 1))
            pp = mapping.get("pp_size", builder.get("pipeline_parallel", 1))
            return int(mapping.get("world_size", tp * pp))
    return None


def layout(repo: Path, world_size: int | None = None) -> Layout:
    """Read the repository's world size from its engines; refuse a ``world_size`` that disagrees."""
    from ..checks import load_configs

    configs, dirs, _ = load_configs(repo)
    worlds: dict[str, int] = {}
    llm_models = []
    gpus = False
    followers = []
    llmapi = []
    llmapi_gpus = 0
    for name, config in configs.items():
        if any(g.kind == g.KIND_GPU for g in config.instance_group):
            gpus = True
        if tritonconfig.parameter(config, "forge_layout") == "llmapi" and \
                tritonconfig.parameter(config, "forge_target") == "tensorrtllm":
            llmapi.append(name)
            llmapi_gpus = max(llmapi_gpus, _llmapi_world(dirs[name]))
            gpus = True
            continue
        tp = tritonconfig.parameter(config, "tensor_parallel")
        if config.backend == "python" and tp and tp.isdigit() and int(tp) > 1:
            worlds[name] = int(tp)
            followers.append(name)
            continue
        if config.backend != "tensorrtllm":
            continue
        gpus = True
        llm_models.append(name)
        world = _engine_world(config, dirs[name])
        if world is not None:
            worlds[name] = world
    engine_worlds = set(worlds.values())
    if len(engine_worlds) > 1:
        raise ValidationError("the repository's engines disagree on the world size: "
                              + ", ".join(f"{m} {w}" for m, w in sorted(worlds.items())))
    engine_world = engine_worlds.pop() if engine_worlds else 1
    if followers and (llm_models or len(followers) > 1):
        raise ValidationError("a repository serves one tensor-parallel model per rank group; this one has "
                              + ", ".join(sorted(followers + llm_models)))
    if world_size is not None and world_size != engine_world:
        raise UsageError(f"--world-size {world_size} disagrees with the repository, which was built for "
                         f"{engine_world} rank(s) (tp × pp)", hint=f"use --world-size {engine_world} or rebuild")
    follower_dir = dirs[followers[0]] / "1" if followers else None
    return Layout(engine_world, tuple(sorted(llm_models)), gpus, follower_dir, tuple(sorted(llmapi)), llmapi_gpus)


def _llmapi_world(model_dir: Path) -> int:
    """tp × pp of an LLM-API model's ``1/model.yaml`` (1 when it does not say)."""
    import yaml

    try:
        doc = yaml.safe_load((model_dir / "1" / "model.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValidationError(f"{model_dir / '1' / 'model.yaml'}: {exc}") from None
    return int(doc.get("tensor_parallel_size", 1) or 1) * int(doc.get("pipeline_parallel_size", 1) or 1)


def check_llmapi_runtime(world: Layout) -> None:
    """Refuse, in one line, to serve LLM-API models where TensorRT-LLM is not installed."""
    import importlib.util

    if world.llmapi_models and importlib.util.find_spec("tensorrt_llm") is None:
        raise ToolMissingError(
            f"model {', '.join(world.llmapi_models)} runs on TensorRT-LLM's LLM API, and this Python has no "
            "tensorrt_llm (it needs NVIDIA GPUs)",
            hint="serve it in the NGC container (forge serve REPO --docker), or build --target python for this machine")


def tritonserver_args(repo: Path, *, rank: int, world: Layout, host: str, http_port: int, grpc_port: int,
                      metrics_port: int, shm_prefix: str, log_file: Path | None = None) -> list[str]:
    """The arguments of one rank's tritonserver (after the binary)."""
    args = [f"--model-repository={repo}", "--disable-auto-complete-config"]
    if rank == 0:
        args += [f"--http-address={host}", f"--http-port={http_port}",
                 f"--grpc-address={host}", f"--grpc-port={grpc_port}",
                 f"--metrics-address={host}", f"--metrics-port={metrics_port}", "--allow-metrics=true"]
        if log_file is not None:
            args.append(f"--log-file={log_file}")
    else:
        # Other ranks only hold their engine shard: explicit loading, no endpoints to bind.
        args += ["--model-control-mode=explicit", *[f"--load-model={m}" for m in world.llm_models],
                 "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
    args.append(f"--backend-config=python,shm-region-prefix-name={shm_prefix}{rank}_")
    return args


def follower_command(world: Layout, python: str = "python3") -> list[str]:
    """A follower rank of a tensor-parallel python-target model (its runtime ships in the repository)."""
    return ["env", f"PYTHONPATH={world.follower_dir}", python, "-m", "forge_decoder.follower"]


def mpirun_command(tritonserver: str, repo: Path, world: Layout, *, host: str = "127.0.0.1",
                   http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                   shm_prefix: str = "prefix", extra: list[str] | None = None,
                   log_file: Path | None = None, mpirun: str = "mpirun", python: str = "python3",
                   options: list[str] | None = None, rendezvous: tuple[str, int] | None = None) -> list[str]:
    """One mpirun line starting ``world.world_size`` ranks (MPMD, one rank each).

    Rank 0 is tritonserver; the other ranks are tritonservers holding only their engine shard
    (tensorrtllm), or followers of a tensor-parallel python model, which meet rank 0 at ``rendezvous``.
    """
    argv = [mpirun, "--allow-run-as-root", *(options or [])]
    exports: list[str] = []  # -x holds for one app context of an MPMD line: repeated in each
    if world.follower_dir is not None:
        address, port = rendezvous or ("127.0.0.1", 29500)
        exports = ["-x", f"MASTER_ADDR={address}", "-x", f"MASTER_PORT={port}"]
    for rank in range(world.world_size):
        if rank:
            argv.append(":")
        if rank and world.follower_dir is not None:
            argv += ["-n", "1", *exports, *follower_command(world, python)]
            continue
        argv += ["-n", "1", *exports, tritonserver, *tritonserver_args(
            repo, rank=rank, world=world, host=host, http_port=http_port, grpc_port=grpc_port,
            metrics_port=metrics_port, shm_prefix=shm_prefix, log_file=log_file)]
        if rank == 0 and extra:
            argv += extra
    return argv


def find_mpirun() -> str | None:
    return shutil.which("mpirun")


def manifest(repo: Path) -> dict[str, Any]:
    """The forge manifest of a repository ({} for hand-written repositories)."""
    path = repo / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}


def backend_version(repo: Path) -> str | None:
    """The tensorrtllm_backend version a forge repository was built for, if it says so."""
    data = manifest(repo)
    spec = data.get("spec") or {}
    if spec.get("backend_version"):
        return spec["backend_version"]
    if data.get("backend_version"):
        return data["backend_version"]
    for component in data.get("components", []):
        for stage in component.get("stages", []):
            notes = stage.get("notes") or {}
            for key in ("backend_version", "profile", "backend"):
                value = notes.get(key)
                if isinstance(value, str):
                    return value
                if isinstance(value, dict) and value.get("version"):
                    return value["version"]
    return None


def check_servable(repo: Path) -> None:
    """Refuse, in one line, a path that is not a valid Triton repository (before any server starts)."""
    from ..checks import validate_repository

    if not repo.is_dir():
        raise UsageError(f"{repo} is not a directory")
    problems = validate_repository(repo)
    if problems:
        more = f" (and {len(problems) - 1} more; see forge validate)" if len(problems) > 1 else ""
        raise ValidationError(f"refusing to serve {repo}: {problems[0]}{more}")


def recorded_container(repo: Path) -> tuple[str, str] | None:
    """(image, backend version) the build recorded in the manifest (decoder emit notes ``backend``); the image is
    "" where no NGC container ships that TensorRT-LLM yet."""
    for component in manifest(repo).get("components", []):
        for stage in component.get("stages", []):
            backend = (stage.get("notes") or {}).get("backend")
            if isinstance(backend, dict) and "container" in backend:
                return backend["container"] or "", backend.get("version", "")
    return None


def _without_trtllm(repo: Path, version: str) -> tuple[str, str]:
    """The container for a repository whose backend version no NGC container ships yet: where no model runs on
    TensorRT-LLM (forge's python target, encoders), the newest tritonserver trtllm container (python backend,
    torch and transformers inside); else the one-line error."""
    from .. import profiles

    try:
        world = layout(repo)
        needs = bool(world.llm_models or world.llmapi_models)
    except ForgeError:
        needs = True
    newest = max((p for p in profiles.PROFILES.values() if p.container), key=lambda p: p.triton)
    if needs:
        raise ForgeError(f"no NGC tritonserver container ships TensorRT-LLM {version} yet",
                         hint="name one with --image (a tritonserver image with this TensorRT-LLM), or build "
                              f"--backend-version {newest.version} for the {newest.triton} container")
    return newest.container, newest.version


def container_image(repo: Path, version: str | None = None) -> tuple[str, str]:
    """(image, backend version) of the NGC tritonserver container for the repository.

    The repository's manifest says which container its build targets; only an explicit
    ``--backend-version`` override (or a repository forge did not write) asks the profile table.
    """
    recorded = None if version else recorded_container(repo)
    if recorded is not None:
        return recorded if recorded[0] else _without_trtllm(repo, recorded[1])
    from .. import profiles  # the one table of backend-version knowledge

    profile = profiles.resolve(version or backend_version(repo))
    if profile.container is None:
        return _without_trtllm(repo, profile.version)
    return profile.container, profile.version


def check_image(image: str) -> None:
    """Refuse an image name that is not one (it goes into a command line)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*", image):
        raise UsageError(f"--image {image!r} is not a container image name")


def docker_command(repo: Path, world: Layout, image: str, *, host: str = "127.0.0.1", http_port: int = 8000,
                   grpc_port: int = 8001, metrics_port: int = 8002, shm_size: str = DEFAULT_SHM_SIZE,
                   gpus: str = "all", log_file: Path | None = None) -> list[str]:
    """``docker run`` of the NGC container serving ``repo``, mounted at the same absolute path.

    The same path inside and outside keeps absolute engine paths in configs valid.
    """
    repo = repo.resolve()
    argv = ["docker", "run", "--rm", "--init", f"--shm-size={shm_size}",
            "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]
    if gpus and gpus != "none":
        argv += ["--gpus", gpus if gpus == "all" else f"device={gpus}"]
    publish = host if host not in ("0.0.0.0", "") else ""
    for port in (http_port, grpc_port, metrics_port):
        argv += ["-p", f"{publish}:{port}:{port}" if publish else f"{port}:{port}"]
    argv += ["-v", f"{repo}:{repo}:ro"]
    if log_file is not None:
        log_file = log_file.resolve()
        argv += ["-v", f"{log_file.parent}:{log_file.parent}"]
    argv.append(image)
    # Inside the container the server listens on every interface; -p decides what the host exposes.
    if world.world_size > 1:
        argv += mpirun_command("/opt/tritonserver/bin/tritonserver", repo, world, host="0.0.0.0",
                               http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                               log_file=log_file)
    else:
        argv += ["/opt/tritonserver/bin/tritonserver", *tritonserver_args(
            repo, rank=0, world=world, host="0.0.0.0", http_port=http_port, grpc_port=grpc_port,
            metrics_port=metrics_port, shm_prefix="prefix", log_file=log_file)]
    return argv


def python_processes(repo: Path) -> dict[str, int]:
    """Python-backend model → how many processes (instances) tritonserver starts for it on rank 0."""
    from ..checks import load_configs

    configs, _, _ = load_configs(repo)
    wanted = {}
    for name, config in sorted(configs.items()):
        if config.backend == "python":
            counts = [max(g.count, 1) * max(len(g.gpus), 1) for g in config.instance_group]
            wanted[name] = max(sum(counts), 1)
    return wanted
