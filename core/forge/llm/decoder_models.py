"""The Triton side of a decoder: preprocessing, tensorrt_llm, postprocessing, BLS and ensemble edges.

Every tensor, parameter and dtype comes from the backend-version profile (:mod:`forge.profiles`),
so a repository built with ``--backend-version v0.5.0`` looks to clients exactly like one made from
that release's templates, and the newest release is the default. Tokenizer files are copied into
each python model's ``1/tokenizer``, so the repository is self-contained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from forge import in_triton
from forge import tritonconfig as tc
from forge.components import Artifact, Component, Edge, TritonModel
from forge.errors import ForgeError, UsageError
from forge.in_triton.forge_glue import TOKENIZER_CORE as _TOKENIZER_CORE, TOKENIZER_FILES

from .. import profiles
from ..profiles import Profile, Tensor
from . import multimodal
from .trtllm_build import sequence_limits  # the one clamping rule of prompt and sequence limits
from .interface import (BLS, LLM, POST, PRE, truthy, message_input, parameter_value, profile_of, resolve_dtype,
    tensorrt_llm_io, tensorrt_llm_parameters)
from .decoder_options import check_options
from .tokenizer_ids import tokenizer_defaults

TOKENIZER_DIR = "tokenizer"  # inside each python model's version directory


# -- models -------------------------------------------------------------------------------------

def _text_tensors(profile: Profile, model: str) -> tuple[list[Tensor], list[Tensor]]:
    spec_io = profile.interface(model)
    return ([t for t in spec_io.inputs if not t.multimodal], [t for t in spec_io.outputs if not t.multimodal])


def _stream_feed(profile: Profile) -> str | None:
    streaming = next((t for t in profile.interface(LLM).inputs if t.name == "streaming"), None)
    return streaming.feed if streaming is not None else None


def _instances(ctx, name: str) -> int:
    return int(ctx.option(name, ctx.option("instances", 1)))


def _batching(ctx, max_batch_size: int) -> dict[str, Any]:
    return {"preferred_batch_size": [max_batch_size],
            "max_queue_delay_microseconds": int(ctx.option("max_queue_delay_microseconds", 0)),
            "max_queue_size": int(ctx.option("max_queue_size", 0))}


def tokenizer_files(source: Path) -> dict[str, bytes]:
    """The tokenizer files of a Hugging Face directory, by name; a clear error when there are none."""
    if not source.is_dir():
        raise UsageError(f"{source} is not a Hugging Face directory, so it has no tokenizer files")
    found = {name: (source / name).read_bytes() for name in TOKENIZER_FILES if (source / name).is_file()}
    if not any(name in found for name in _TOKENIZER_CORE):
        raise UsageError(f"{source} has no tokenizer (none of {', '.join(_TOKENIZER_CORE)})",
                         hint="copy the model's tokenizer files into the checkpoint directory")
    return found


def _python_files(model_py: Path, tokenizer: Mapping[str, bytes]) -> dict[str, Path | bytes | str]:
    # Contents, not paths: the driver hard-links paths, and a repository must never share inodes
    # with forge's own sources or the user's checkpoint (editing one would change the other).
    files: dict[str, Path | bytes | str] = {"1/model.py": model_py.read_bytes(),
                                            "1/forge_text.py": in_triton.TEXT.read_bytes(), **in_triton.glue_files()}
    files.update({f"1/{TOKENIZER_DIR}/{name}": data for name, data in tokenizer.items()})
    return files


def _flag(params: Mapping[str, Any], key: str, options: Mapping[str, Any]) -> str:
    """A tokenizer flag of forge's python models: -o value, else the profile's default, else true."""
    value = options.get(key, params.get(key))
    return "true" if value is None or truthy(value) else "false"


def _max_input_len(spec, meta: Mapping[str, Any]) -> int:
    return sequence_limits(spec, meta)[0]


def preprocessing_model(component: Component, profile: Profile, ctx, tokenizer: Mapping[str, bytes],
                        defaults: Mapping[str, Any], meta: Mapping[str, Any]) -> TritonModel:
    """forge's preprocessing model with ``profile``'s tensor interface."""
    spec = ctx.spec
    inputs, outputs = _text_tensors(profile, PRE)
    params = {p.key: parameter_value(p, spec.options) for p in profile.params(PRE)
              if p.key not in ("tokenizer_dir", "gpt_model_path")}
    params.update({
        "tokenizer_dir": TOKENIZER_DIR,
        "add_special_tokens": _flag(params, "add_special_tokens", spec.options),
        "end_id": ctx.option("end_id", defaults["end_id"]),
        "pad_id": ctx.option("pad_id", defaults["pad_id"]),
        "stop_token_ids": ctx.option("stop_token_ids", defaults["stop_token_ids"]),
        "vocab_size": meta.get("vocab_size_padded") or meta.get("vocab_size") or defaults["vocab"],
        "max_input_len": _max_input_len(spec, meta),
        "trust_remote_code": spec.trust_remote_code,
    })
    if "gpt_model_path" in {p.key for p in profile.params(PRE)} and "engine_dir" in spec.options:
        params["gpt_model_path"] = str(spec.options["engine_dir"])
    table_inputs, table_params = multimodal.preprocessing_io(component)  # an encoder fills the prompt table
    params.update(table_params)
    batching = _batching(ctx, spec.limits.max_batch_size) if PRE in profile.dynamic_batching else False
    config = tc.model_config(
        component.model_name(PRE), backend="python", max_batch_size=spec.limits.max_batch_size,
        inputs=[message_input(t, t.dtype, ensemble_facing=True) for t in inputs] + table_inputs,
        outputs=[tc.model_output(t.name, t.dtype, t.dims) for t in outputs],
        parameters=params, instances=_instances(ctx, "preprocessing_instance_count"),
        dynamic_batching=batching)
    return TritonModel(config, _python_files(in_triton.PREPROCESSING, tokenizer))


def postprocessing_model(component: Component, profile: Profile, ctx, tokenizer: Mapping[str, bytes],
                         meta: Mapping[str, Any], engine_dir: Path | None, decoupled: bool) -> TritonModel:
    """forge's postprocessing model; behind a decoupled tensorrt_llm it decodes streamed pieces in context."""
    spec = ctx.spec
    inputs, outputs = _text_tensors(profile, POST)
    params = {p.key: parameter_value(p, spec.options) for p in profile.params(POST) if p.key != "tokenizer_dir"}
    params.update({
        "tokenizer_dir": TOKENIZER_DIR,
        "skip_special_tokens": _flag(params, "skip_special_tokens", spec.options),
        # Triton ensembles cannot join the request's own tensors with a decoupled model's outputs in
        # one step, so postprocessing cannot see the `stream` flag: behind a decoupled tensorrt_llm
        # every response is decoded as a piece of a stream (exact bytes, spaces kept).
        "streaming": decoupled,
        "trust_remote_code": spec.trust_remote_code,
    })
    config = tc.model_config(
        component.model_name(POST), backend="python", max_batch_size=spec.limits.max_batch_size,
        inputs=[message_input(t, resolve_dtype(t.dtype, spec, meta, engine_dir)) for t in inputs],
        outputs=[tc.model_output(t.name, resolve_dtype(t.dtype, spec, meta, engine_dir), t.dims) for t in outputs],
        parameters=params, instances=_instances(ctx, "postprocessing_instance_count"),
        dynamic_batching=POST in profile.dynamic_batching)
    return TritonModel(config, _python_files(in_triton.POSTPROCESSING, tokenizer))


def bls_routes(profile: Profile) -> dict[str, Any]:
    """How the BLS model maps its tensors onto preprocessing and tensorrt_llm (same names as the ensemble)."""
    bls_inputs = {t.name for t in profile.interface(BLS).inputs}
    bls_outputs = {t.name for t in profile.interface(BLS).outputs}
    routes = profiles.routes(profile, include=lambda model, t: not t.multimodal)
    post_in = {t.name: t.src for t in profile.interface(POST).inputs if t.src}
    outputs = []
    for model, tensor, name in routes.results:
        if name == "text_output" or name not in bls_outputs:
            continue
        if model == LLM:
            outputs.append([tensor, name])
        elif model == POST and tensor.startswith("OUT_") and (post_in.get(tensor[4:]) or "").startswith(LLM + "."):
            outputs.append([post_in[tensor[4:]].split(".", 1)[1], name])
    stream = _stream_feed(profile)
    return {
        "preprocessing": [[feed, tensor] for feed, model, tensor in routes.feeds if model == PRE and feed in bls_inputs],
        "tensorrt_llm": [[feed, tensor] for feed, model, tensor in routes.feeds if model == LLM and feed in bls_inputs],
        "links": [[src_t, dst_t] for src_m, src_t, dst_m, dst_t in routes.links if src_m == PRE and dst_m == LLM],
        "outputs": outputs,
        "stream_input": "streaming" if stream else None,
    }


def bls_model(component: Component, profile: Profile, ctx, tokenizer: Mapping[str, bytes],
              meta: Mapping[str, Any], engine_dir: Path | None, decoupled: bool) -> TritonModel:
    """forge's tensorrt_llm_bls model with ``profile``'s BLS interface."""
    spec = ctx.spec
    spec_io = profile.interface(BLS)
    params = {p.key: parameter_value(p, spec.options) for p in profile.params(BLS)}
    params.update({
        "tensorrt_llm_model_name": component.model_name(LLM),
        "preprocessing_model_name": component.model_name(PRE),
        "tokenizer_dir": TOKENIZER_DIR,
        "skip_special_tokens": _flag({}, "skip_special_tokens", spec.options),
        "forge_routes": json.dumps(bls_routes(profile), separators=(",", ":")),
        "trust_remote_code": spec.trust_remote_code,
    })
    config = tc.model_config(
        component.model_name(BLS), backend="python", max_batch_size=spec.limits.max_batch_size,
        inputs=[message_input(t, resolve_dtype(t.dtype, spec, meta, engine_dir)) for t in spec_io.inputs],
        outputs=[tc.model_output(t.name, resolve_dtype(t.dtype, spec, meta, engine_dir), t.dims)
                 for t in spec_io.outputs],
        parameters=params, instances=_instances(ctx, "bls_instance_count"), decoupled=decoupled)
    return TritonModel(config, _python_files(in_triton.BLS, tokenizer))


def engine_files(engine_dir: Path) -> dict[str, Path]:
    """``1/<file>`` → file for every file of a built engine directory (logs left out)."""
    files = {f"1/{path.relative_to(engine_dir).as_posix()}": path
             for path in sorted(engine_dir.rglob("*")) if path.is_file() and path.suffix != ".log"}
    if "1/config.json" not in files or not any(k.endswith(".engine") for k in files):
        raise ForgeError(f"engine directory {engine_dir} lacks config.json or rank*.engine files",
                         hint="rebuild the engine (the compile stage did not finish)")
    return files


def tensorrt_llm_model(component: Component, profile: Profile, ctx, artifact: Artifact) -> TritonModel:
    """The C++ ``tensorrt_llm`` model serving the engine placed in ``tensorrt_llm/1``."""
    spec = ctx.spec
    engine_dir = Path(artifact.path)
    name = component.model_name(LLM)
    # The C++ backend reads gpt_model_path as given (relative paths would follow the server's cwd),
    # so point at the engine's final place; -o engine_dir=… overrides it for repositories mounted elsewhere.
    default_path = str((spec.out / name / "1").resolve())
    inputs, outputs = tensorrt_llm_io(profile, spec, artifact.meta, engine_dir)
    params = tensorrt_llm_parameters(profile, spec, engine_dir=default_path, log=ctx.log)
    if component.options.get("lora") and profile.parameter(LLM, "lora_prefetch_dir") and \
            "lora_prefetch_dir" not in spec.options:  # the backend loads the shipped adapters at start
        from .lora_format import FOLDER

        params["lora_prefetch_dir"] = str((spec.out / name / FOLDER).resolve())
    decoupled = truthy(ctx.option("decoupled", False))
    batching = _batching(ctx, spec.limits.max_batch_size) if LLM in profile.dynamic_batching else False
    config = tc.model_config(name, backend="tensorrtllm", max_batch_size=spec.limits.max_batch_size,
                             inputs=inputs, outputs=outputs, parameters=params, instances=1,
                             instance_kind="KIND_CPU", dynamic_batching=batching, decoupled=decoupled)
    world = int(artifact.meta.get("world_size", 1) or 1)
    if world > 1:
        ctx.log(f"{name}: {world} ranks; serve it with one MPI rank per GPU (forge serve does this, or "
                f"launch tritonserver under mpirun -n {world})")
    return TritonModel(config, engine_files(engine_dir))


def _engine_llm(adapter, component: Component, artifact: Artifact, ctx,
                profile: Profile) -> tuple[TritonModel, Path | None]:
    """``--target tensorrtllm``: the C++ backend's model over the built engine."""
    if artifact.kind != "trtllm-engine":
        raise ForgeError(f"--target tensorrtllm needs a built engine, but the compile stage returned "
                         f"a {artifact.kind!r} artifact")
    return tensorrt_llm_model(component, profile, ctx, artifact), Path(artifact.path)


def _python_llm(adapter, component: Component, artifact: Artifact, ctx,
                profile: Profile) -> tuple[TritonModel, Path | None]:
    """``--target python``: forge's python-backend model with the same tensor interface."""
    try:
        from .pytarget import emit_model
    except ImportError as exc:
        raise ForgeError(f"--target python is not available in this forge installation ({exc})") from None
    return emit_model(adapter, component, artifact, ctx, profile), None


#: How each target builds the ``tensorrt_llm`` model; the text models around it are the same for all.
LLM_BUILDERS: Mapping[str, Callable[..., tuple[TritonModel, Path | None]]] = {
    "tensorrtllm": _engine_llm,
    "python": _python_llm,
}


def emit(adapter, component: Component, artifact: Artifact, ctx) -> list[TritonModel]:
    """Every Triton model of a decoder component (the ensemble comes from :func:`edges`)."""
    profile = check_options(ctx.spec)
    if profile.llmapi:
        return [_llmapi_model(adapter, component, artifact, ctx, profile)]
    meta = dict(artifact.meta or {})
    tokenizer = tokenizer_files(component.source)
    defaults = tokenizer_defaults(component.source, ctx.spec)
    from ..in_triton import forge_text

    backend = forge_text.backend_file(str(component.source), ctx.spec.trust_remote_code)
    if backend is not None:  # the text models then load without transformers' tokenizer classes
        tokenizer[forge_text.BACKEND_FILE] = backend
    builder = LLM_BUILDERS.get(ctx.target)
    if builder is None:
        raise UsageError(f"decoders build for --target {' or '.join(LLM_BUILDERS)}, not {ctx.target}")
    llm, engine_dir = builder(adapter, component, artifact, ctx, profile)
    _ship_loras(adapter, component, ctx, llm)
    decoupled = llm.config.model_transaction_policy.decoupled
    models = [preprocessing_model(component, profile, ctx, tokenizer, defaults, meta), llm,
              postprocessing_model(component, profile, ctx, tokenizer, meta, engine_dir, decoupled)]
    if truthy(ctx.option("bls", False)):
        models.append(bls_model(component, profile, ctx, tokenizer, meta, engine_dir, decoupled))
    # serving reads the container from the manifest, not from this package
    ctx.note("backend", {"version": profile.version, "container": profile.container})
    ctx.log(f"{component.name}: tensorrtllm_backend {profile.version} interface "
            f"(container {profile.container})")
    return models


def _llmapi_model(adapter, component: Component, artifact: Artifact, ctx, profile: Profile) -> TritonModel:
    """The one model of an LLM-API release's repository: ``tensorrt_llm`` taking text (either target)."""
    tokenizer_files(component.source)  # a checkpoint without a tokenizer fails here, with the reason
    if ctx.target == "tensorrtllm":
        from . import llmapi

        model = llmapi.emit(adapter, component, artifact, ctx, profile)
    elif ctx.target == "python":
        model, _ = _python_llm(adapter, component, artifact, ctx, profile)
        _ship_loras(adapter, component, ctx, model)
    else:
        raise UsageError(f"decoders build for --target tensorrtllm or python, not {ctx.target}")
    where = profile.container or "no NGC tritonserver container ships it yet"
    ctx.note("backend", {"version": profile.version, "container": profile.container, "layout": profile.layout})
    ctx.log(f"{component.name}: TensorRT-LLM {profile.version} LLM-API interface ({where})")
    return model


def _ship_loras(adapter, component: Component, ctx, llm: TritonModel) -> None:
    """``--lora``: the adapters in the tensorrt_llm model's ``lora/<task id>/`` (the form a client sends,
    and tensorrtllm_backend's lora_prefetch_dir layout) and their manifest entries."""
    lora = component.options.get("lora")
    if not lora:
        return
    from .lora_format import repository_files

    files, entries = repository_files(adapter, ctx.spec, component.source, lora)
    llm.files.update(files)
    ctx.note("lora", {"model": llm.name, "adapters": entries})
    for entry in entries:
        for warning in entry["warnings"]:
            ctx.log(f"warning: {warning}")
    ctx.log(f"{llm.name}: LoRA adapters " + ", ".join(f"{e['name']} (task {e['task_id']}, rank {e['rank']})"
                                                     for e in entries))


def edges(component: Component, models: Mapping[str, TritonModel], ctx) -> list[Edge]:
    """The ensemble of a decoder component: ``text_input`` → preprocessing → tensorrt_llm → postprocessing."""
    profile = profile_of(ctx.spec)
    if profile.llmapi:  # one model takes text itself: nothing to wire
        return []
    ensemble = component.ensemble
    name = {role: component.model_name(role) for role in (PRE, LLM, POST)}
    routes = profiles.routes(profile, include=lambda model, t: not t.multimodal)
    # tensors another component's model produces (multimodal.edges) are not the client's to send
    linked = set(multimodal.FED) if multimodal.prompt_table(component) else set()
    result: list[Edge] = []
    for feed, model, tensor in routes.feeds:
        if (model, tensor) in linked:
            continue
        result.append(Edge.feed(feed, name[model], tensor, ensemble=ensemble))
    for src_model, src_tensor, dst_model, dst_tensor in routes.links:
        result.append(Edge.link(name[src_model], src_tensor, name[dst_model], dst_tensor, ensemble=ensemble))
    for model, tensor, output in routes.results:
        result.append(Edge.result(name[model], tensor, output, ensemble=ensemble))
    return result
