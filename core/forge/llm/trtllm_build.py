"""The compile stage for ``--target tensorrtllm``: ``trtllm-build`` over a unified checkpoint.

The command line follows the flag set of the chosen backend version (``--backend-version``; the
newest when absent) and is run through ``ctx.run_tool``, so it lands in the manifest and a missing
``trtllm-build`` becomes a clear error naming the command and the ``python`` target.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Mapping

from forge.components import Artifact
from forge.errors import ForgeError

from . import loadercheck
from ..profiles import BUILD_FLAGS, parse_version

ARTIFACT_KIND = "trtllm-engine"


def _switch(value: bool) -> str:
    return "enable" if value else "disable"


def sequence_limits(spec, meta: Mapping[str, Any]) -> tuple[int, int]:
    """(max_input_len, max_seq_len) of the build: within the model's position table, with room to generate.

    A sequence limit beyond the position table is cut to the table; if the prompt limit then leaves no
    room for output, the prompt keeps the share of the sequence it was asked for (the defaults, 1024 of
    2048: half), so a 128-position model gets 64 prompt tokens and 64 to generate, not 127 and 1.
    """
    lim = spec.limits
    seq, inp = lim.max_seq_len, lim.max_input_len
    positions = meta.get("max_position_embeddings")
    if isinstance(positions, int) and 1 < positions < seq:  # no position beyond the model's table
        seq = positions
        if inp >= seq:
            inp = max(1, seq * lim.max_input_len // lim.max_seq_len)
    return inp, seq


def clamped_limits(spec, meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """What :func:`sequence_limits` changed and why (None when the requested limits fit the model)."""
    used = sequence_limits(spec, meta)
    asked = (spec.limits.max_input_len, spec.limits.max_seq_len)
    if used == asked:
        return None
    return {"requested": {"max_input_len": asked[0], "max_seq_len": asked[1]},
            "used": {"max_input_len": used[0], "max_seq_len": used[1]},
            "why": f"the model has {meta['max_position_embeddings']} positions; the prompt keeps its requested "
                   f"share of the sequence, leaving {used[1] - used[0]} tokens to generate"}


def build_command(checkpoint_dir: Path, output_dir: Path, meta: Mapping[str, Any], spec,
                  options: Mapping[str, Any], lora: Mapping[str, Any] | None = None,
                  prompt_table_rows: int = 0) -> list[str]:
    """The ``trtllm-build`` argv for a checkpoint, the build limits and the backend version.

    ``lora``: the build's adapters (LoRA plugin flags). ``prompt_table_rows``: the prompt-table rows of
    one request (a multimodal model's visual tokens); the engine reserves them for every sequence of a
    full batch.
    """
    version = parse_version(spec.backend_version)
    lim = spec.limits
    max_input_len, max_seq_len = sequence_limits(spec, meta)
    dtype = meta["dtype"]
    quant = meta.get("quant") or {}
    argv = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(output_dir),
            "--max_batch_size", str(lim.max_batch_size), "--max_input_len", str(max_input_len)]
    if version >= BUILD_FLAGS["max_seq_len"]:
        argv += ["--max_seq_len", str(max_seq_len)]
    else:  # older builds bound the generated tokens instead of the whole sequence
        argv += ["--max_output_len", str(max_seq_len - max_input_len)]
    argv += ["--max_beam_width", str(lim.max_beam_width)]
    if lim.max_num_tokens:
        argv += ["--max_num_tokens", str(lim.max_num_tokens)]
    if prompt_table_rows:
        table_flag = "--max_multimodal_len" if version >= BUILD_FLAGS["max_multimodal_len"] \
            else "--max_prompt_embedding_table_size"
        argv += [table_flag, str(lim.max_batch_size * prompt_table_rows)]
    argv += ["--gpt_attention_plugin", dtype]
    if quant.get("quant_algo") != "FP8":  # FP8 GEMMs run in TensorRT itself, not the gemm plugin
        argv += ["--gemm_plugin", dtype]
    if version >= BUILD_FLAGS["kv_cache_type"]:
        argv += ["--kv_cache_type", "paged"]
    else:
        argv += ["--paged_kv_cache", "enable"]
    argv += ["--remove_input_padding", "enable"]
    fmha = dtype != "float32" and bool(options.get("context_fmha", True))  # fused MHA has no fp32 kernels
    argv += ["--context_fmha", _switch(fmha)]
    if version >= BUILD_FLAGS["paged_context_fmha"]:
        argv += ["--use_paged_context_fmha", _switch(fmha and bool(options.get("paged_context_fmha", True)))]
    if version >= BUILD_FLAGS["multiple_profiles"]:
        argv += ["--multiple_profiles", _switch(bool(options.get("multiple_profiles", True)))]
    if lora:
        from .lora_format import build_flags

        argv += build_flags(lora, dtype)
    workers = int(options.get("workers") or meta.get("world_size", 1))
    if workers > 1:
        argv += ["--workers", str(workers)]
    extra = options.get("trtllm_build_args")
    if extra:
        argv += shlex.split(str(extra))
    return argv


def compile(artifact: Artifact, ctx, lora: Mapping[str, Any] | None = None,  # noqa: A001 (the stage's name)
            prompt_table_rows: int = 0) -> Artifact | None:
    """The compile stage: build engines into ``ctx.workdir/engine`` (only record the command on --dry-run).

    ``lora``: the build's adapters (:func:`forge.llm.lora_format.summary`), which add the LoRA plugin flags;
    ``prompt_table_rows``: a multimodal model's prompt-table rows per request."""
    meta = dict(artifact.meta)
    spec = ctx.spec
    output_dir = ctx.workdir / "engine"
    # Run inside the stage's work directory with a relative --output_dir: the recorded command stays
    # meaningful after the driver moves the work directory into its cache.
    argv = build_command(artifact.path, Path("engine"), meta, spec, spec.options, lora, prompt_table_rows)
    version = parse_version(spec.backend_version)
    max_input_len, max_seq_len = sequence_limits(spec, meta)
    clamped = clamped_limits(spec, meta)
    if clamped:
        asked, used = clamped["requested"], clamped["used"]
        ctx.note("limits", clamped)
        ctx.log(f"warning: --max-seq-len {asked['max_seq_len']} → {used['max_seq_len']} and --max-input-len "
                f"{asked['max_input_len']} → {used['max_input_len']}: {clamped['why']}")
    if version < BUILD_FLAGS["trtllm_build"]:  # only a --dry-run gets here (the plan refuses real builds)
        from .decoder_options import no_trtllm_build

        ctx.note("compatibility", no_trtllm_build(spec.backend_version) + "; no engine command is recorded")
        ctx.log(f"note: {no_trtllm_build(spec.backend_version)}; the plan records no engine command")
        return None
    loadercheck.check_build_command(ctx, argv)
    ctx.run_tool(argv, purpose="--target tensorrtllm (building TensorRT-LLM engines)", cwd=ctx.workdir)
    if ctx.dry_run:
        return None  # nothing was built; the plan shows the command
    world = int(meta.get("world_size", 1))
    missing = [f"rank{r}.engine" for r in range(world) if not (output_dir / f"rank{r}.engine").is_file()]
    if not (output_dir / "config.json").is_file():
        missing.insert(0, "config.json")
    if missing:
        raise ForgeError(f"trtllm-build finished but {output_dir} lacks {', '.join(missing)}",
                         hint=f"see {ctx.workdir / 'trtllm-build.log'}")
    try:
        built = json.loads((output_dir / "config.json").read_text())
    except ValueError as exc:
        raise ForgeError(f"trtllm-build wrote an unreadable {output_dir / 'config.json'}: {exc}") from None
    lim = spec.limits
    meta["engine"] = {
        "backend_version": spec.backend_version,
        "max_batch_size": lim.max_batch_size, "max_input_len": max_input_len,
        "max_seq_len": max_seq_len, "max_num_tokens": lim.max_num_tokens,
        "max_beam_width": lim.max_beam_width, "paged_kv_cache": True, "remove_input_padding": True,
        "max_prompt_embedding_table_size": lim.max_batch_size * prompt_table_rows,
        "trtllm_version": built.get("version"),
    }
    ctx.note("engine", {"files": sorted(p.name for p in output_dir.iterdir()), "command": shlex.join(argv)})
    return Artifact(ARTIFACT_KIND, output_dir, meta)
