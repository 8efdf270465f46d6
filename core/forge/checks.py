"""``forge validate``: static checks of any Triton model repository, hand-written ones included."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from . import ensemble, tritonconfig
from .errors import ValidationError

_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


def load_configs(repo: Path) -> tuple[dict[str, mc.ModelConfig], dict[str, Path], list[str]]:
    """Parse every ``*/config.pbtxt``; return configs by model name, their dirs, and problems."""
    configs: dict[str, mc.ModelConfig] = {}
    dirs: dict[str, Path] = {}
    problems: list[str] = []
    for model_dir in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        path = model_dir / tritonconfig.CONFIG_FILE
        if not path.is_file():
            continue  # Triton needs no config for some backends; nothing to check statically
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"{path}: cannot read: {exc}")
            continue
        placeholders = []
        for number, line in enumerate(text.splitlines(), 1):
            placeholders += [f"${{{m}}} (line {number})" for m in _PLACEHOLDER.findall(line)]
        if placeholders:
            problems.append(f"{path}: unfilled placeholders: {', '.join(placeholders)}")
        try:
            config = tritonconfig.parse(text, str(path))
        except ValidationError as exc:
            if not placeholders:  # a placeholder already explains the parse failure
                problems.append(str(exc))
            continue
        name = config.name or model_dir.name
        if config.name and config.name != model_dir.name:
            problems.append(f"{path}: name {config.name!r} differs from its directory {model_dir.name!r}")
        if config.platform != "ensemble" and not any(p.is_dir() and p.name.isdigit() for p in model_dir.iterdir()):
            problems.append(f"{model_dir}: no numeric version directory (e.g. {model_dir.name}/1)")
        configs[name] = config
        dirs[name] = model_dir
    return configs, dirs, problems


def _decoupled(config: mc.ModelConfig) -> bool:
    return config.model_transaction_policy.decoupled


def _engine_dir(config: mc.ModelConfig, model_dir: Path, located_at: Path | None) -> Path | None:
    raw = tritonconfig.parameter(config, "gpt_model_path") or tritonconfig.parameter(config, "engine_dir")
    if raw and "${" not in raw:
        path = Path(raw)
        if located_at is not None and path.is_absolute():
            try:  # a repository checked before it is moved to where its paths point
                path = model_dir.parent / path.relative_to(located_at.resolve())
            except ValueError:
                pass
        return path if path.is_absolute() else (model_dir / path)
    version_dir = model_dir / "1"
    return version_dir if (version_dir / "config.json").is_file() else None


def _check_engine(config: mc.ModelConfig, model_dir: Path, located_at: Path | None) -> list[str]:
    engine = _engine_dir(config, model_dir, located_at)
    if engine is None or not (engine / "config.json").is_file():
        return []
    try:
        data = json.loads((engine / "config.json").read_text())
    except ValueError as exc:
        return [f"{engine / 'config.json'}: invalid json: {exc}"]
    mapping = data.get("pretrained_config", {}).get("mapping") or {}
    builder = data.get("builder_config", {})
    tp = mapping.get("tp_size", builder.get("tensor_parallel", 1))
    pp = mapping.get("pp_size", builder.get("pipeline_parallel", 1))
    world = mapping.get("world_size", tp * pp)
    problems = []
    if world != tp * pp:
        problems.append(f"{engine / 'config.json'}: world_size {world} ≠ tp_size {tp} × pp_size {pp}")
    ranks = sorted(engine.glob("rank*.engine"))
    if ranks and len(ranks) != tp * pp:
        problems.append(f"{engine}: {len(ranks)} rank engine files but tp×pp = {tp * pp}")
    return problems


def validate_repository(repo: Path, located_at: Path | None = None) -> list[str]:
    """Every problem found in ``repo`` (empty list: the repository is consistent).

    ``located_at``: where the repository will live, when absolute paths inside it point there.
    """
    if not repo.is_dir():
        raise ValidationError(f"{repo} is not a directory")
    configs, dirs, problems = load_configs(repo)
    if not configs and not problems:
        problems.append(f"{repo}: no model directories with a config.pbtxt")
    for name, config in configs.items():
        if config.platform == "ensemble":
            problems += ensemble.check(config, configs)
        if config.backend == "tensorrtllm":
            problems += _check_engine(config, dirs[name], located_at)
        target = tritonconfig.parameter(config, "tensorrt_llm_model_name")
        if target and "${" not in target and config.backend == "python":
            llm = configs.get(target)
            if llm is None:
                problems.append(f"{dirs[name]}: tensorrt_llm_model_name {target!r} is not in the repository")
            elif _decoupled(llm) != _decoupled(config):
                problems.append(
                    f"{dirs[name]}: decoupled mode {str(_decoupled(config)).lower()} differs from "
                    f"{target!r} ({str(_decoupled(llm)).lower()}); BLS and tensorrt_llm must match")
    return problems
