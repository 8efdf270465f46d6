"""Build decoder repositories in tests by calling ``forge.llm.decoder_models`` the way the driver does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge import ensemble
from forge import publish as repo_writer
from forge.components import Artifact, Component, TritonModel
from forge.context import BuildContext, StageRecord
from forge.llm import decoder_models as repository
from forge.spec import BuildSpec
from forge.checks import validate_repository

import engine_double


#: The newest release with the engine layout (preprocessing → tensorrt_llm → postprocessing), which these
#: helpers build unless told otherwise; the LLM-API layout has tests of its own (test_llmapi.py).
ENGINE = "v1.2.1"


def context(source: Path, out: Path, *, version: str | None = None, target: str = "tensorrtllm",
            options: dict[str, Any] | None = None, prefix: str = "", **spec_fields: Any) -> BuildContext:
    spec = BuildSpec(families=["gpt"], model=source, out=out, backend_version=version or ENGINE, target=target,
                     options=dict(options or {}), name_prefix=prefix, **spec_fields)
    logged: list[str] = []
    ctx = BuildContext(spec=spec, target=target, workdir=out.parent, record=StageRecord("emit_config", ""),
                       log=logged.append)
    ctx.logged = logged  # type: ignore[attr-defined]
    return ctx


def component(source: Path, prefix: str = "") -> Component:
    return Component(name=f"{prefix}gpt", family="gpt", role="llm", source=source, prefix=prefix,
                     ensemble=f"{prefix}ensemble")


def engine_artifact(tmp: Path, **engine: Any) -> Artifact:
    path = engine_double.write_engine_dir(tmp / "engine-double", **engine)
    world = engine.get("tp", 1) * engine.get("pp", 1)
    return Artifact("trtllm-engine", path, {"architecture": "GPT2LMHeadModel", "dtype": "float16",
                                             "tp": engine.get("tp", 1), "pp": engine.get("pp", 1),
                                             "world_size": world, "vocab_size": engine.get("vocab_size", 420),
                                             "max_position_embeddings": 1024})


def emit(source: Path, out: Path, tmp: Path, *, version: str | None = None,
         options: dict[str, Any] | None = None, prefix: str = "", **engine: Any):
    """(models by name, edges, ctx, component) for a tensorrtllm-target build with an engine double."""
    ctx = context(source, out, version=version, options=options, prefix=prefix)
    comp = component(source, prefix)
    models = {m.name: m for m in repository.emit(None, comp, engine_artifact(tmp, **engine), ctx)}
    return models, repository.edges(comp, models, ctx), ctx, comp


def write(models: dict[str, TritonModel], edges, out: Path) -> list[str]:
    """Assemble the ensembles like the driver, write every model, return validate's problems."""
    configs = {name: m.config for name, m in models.items()}
    groups: dict[str, list] = {}
    for edge in edges:
        groups.setdefault(edge.ensemble, []).append(edge)
    everything = dict(models)
    for name, group in groups.items():
        everything[name] = TritonModel(ensemble.assemble(name, group, configs))
    out.mkdir(parents=True, exist_ok=True)
    for model in everything.values():
        repo_writer.write_model(model, out)
    return validate_repository(out)
