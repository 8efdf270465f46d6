"""Hugging Face decoder checkpoint → TensorRT-LLM unified checkpoint, streamed tensor by tensor.

The output directory holds ``config.json`` and one ``rank{N}.safetensors`` per GPU (rank =
pp_rank·tp + tp_rank), with the tensor names and layouts TensorRT-LLM's loader expects. Source
tensors are memory-mapped (:mod:`.tensorio`) and cut into per-rank row blocks (:mod:`.sharding`)
that the copy engine (:mod:`.transfer`) converts and writes straight to their place in pre-sized
rank files (:mod:`.rankfile`), so peak memory stays at a few chunks whatever the model size. The
parity check lives in :mod:`.decoder_parity`.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from forge import __version__
from forge.components import Artifact
from forge.errors import UsageError

from .adapter import DecoderAdapter
from .decoder_parity import check_parity
from .rankfile import RankWriter, copy_alignment
from .sharding import Planned, check_parallelism, plan, stage_layers
from .tensorio import DTYPE_TAGS, Scratch, SourceIndex
from .transfer import Transfers, write_job

ARTIFACT_KIND = "trtllm-checkpoint"

# -- validation -----------------------------------------------------------------------------------

_REQUIRED = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_size", "vocab_size",
             "intermediate_size", "max_position_embeddings")


def check_config(adapter: DecoderAdapter, norm: Mapping[str, Any], where: str,
                 hf_config: Mapping[str, Any] | None = None) -> None:
    """Refuse configs that lack a size TensorRT-LLM needs, use a feature it lacks, or whose heads do not fit."""
    for key, (value, why) in adapter.unsupported.items():
        if hf_config is not None and key in hf_config and hf_config[key] == value:
            raise UsageError(f"{where}: config.json sets {key}={json.dumps(value)}, which TensorRT-LLM cannot "
                             f"build: {why}")
    for name in _REQUIRED:
        value = norm.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            keys = " or ".join(adapter.config_fields.get(name, ())) or name
            raise UsageError(f"{where}: config.json has no usable {keys} ({name}); got {value!r}")
    if norm["num_heads"] % norm["num_kv_heads"]:
        raise UsageError(f"{where}: {norm['num_heads']} attention heads are not a multiple of "
                         f"{norm['num_kv_heads']} key/value heads")


# -- the export stage -----------------------------------------------------------------------------

def trtllm_config(adapter: DecoderAdapter, norm: Mapping[str, Any], dtype: str, tp: int, pp: int,
                  quantization: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The TensorRT-LLM ``config.json`` of a converted checkpoint."""
    config = {
        "producer": {"name": "forge", "version": __version__},
        "architecture": adapter.trtllm_architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": norm["vocab_size"],
        "max_position_embeddings": norm["max_position_embeddings"],
        "hidden_size": norm["hidden_size"],
        "num_hidden_layers": norm["num_layers"],
        "num_attention_heads": norm["num_heads"],
        "num_key_value_heads": norm["num_kv_heads"],
        "head_size": norm["head_size"],
        "intermediate_size": norm["intermediate_size"],
        "hidden_act": norm["hidden_act"],
        "norm_epsilon": norm["norm_epsilon"],
        # Embeddings are whole on every first-stage rank and lm_head is its own (vocab-split) tensor.
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": False,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": dict(quantization or {"quant_algo": None, "kv_cache_quant_algo": None}),
    }
    config.update(adapter.trtllm_config(norm))
    return config


def checkpoint_meta(adapter: DecoderAdapter, norm: Mapping[str, Any], hf_architecture: str, dtype: str,
                    tp: int, pp: int, source: Path) -> dict[str, Any]:
    """The artifact metadata later stages (quantize, compile, emit_config) read."""
    return {
        "family": adapter.family,
        "architecture": adapter.trtllm_architecture,
        "hf_architecture": hf_architecture,
        "dtype": dtype,
        "tp": tp, "pp": pp, "world_size": tp * pp,
        "vocab_size": norm["vocab_size"],
        "vocab_size_padded": -(-norm["vocab_size"] // tp) * tp,
        "hidden_size": norm["hidden_size"],
        "num_layers": norm["num_layers"],
        "num_heads": norm["num_heads"],
        "num_kv_heads": norm["num_kv_heads"],
        "head_size": norm["head_size"],
        "intermediate_size": norm["intermediate_size"],
        "max_position_embeddings": norm["max_position_embeddings"],
        "hidden_act": norm["hidden_act"],
        "pp_layers": [list(stage_layers(norm["num_layers"], pp, s)) for s in range(pp)],
        # Mistral-style sliding-window attention is a runtime setting of TensorRT-LLM (max_attention_window)
        "sliding_window": norm.get("sliding_window"),
        "source": str(Path(source).resolve()),
        "quant": {},
    }


def convert_checkpoint(adapter: DecoderAdapter, config: Mapping[str, Any], weight_files: Sequence[Path],
                       out: Path, *, dtype: str, tp: int, pp: int, weight_format: str = "safetensors",
                       prefixes: Sequence[str] | None = None, where: str = "checkpoint",
                       log: Callable[[str], None] = lambda m: None, write: bool = True,
                       uneven_pp: bool = True) -> dict[str, Any]:
    """Convert a checkpoint (config dict + weight files) into ``out``; return the normalized config.

    With ``write=False`` only the checks run (config, parallelism, every tensor's name, dtype and
    shape, read from the headers), which is what ``--dry-run`` does.
    """
    if dtype not in DTYPE_TAGS:
        raise UsageError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPE_TAGS)}")
    architecture = (config.get("architectures") or [""])[0]
    if not adapter.accepts(architecture):
        raise UsageError(f"{where}: architecture {architecture or '(none in config.json)'!r} is not supported by "
                         f"family {adapter.family!r}; supported: {', '.join(adapter.architectures)}")
    norm = adapter.normalize(config)
    check_config(adapter, norm, where, config)
    check_parallelism(norm, tp, pp, where, uneven_pp)
    tag = DTYPE_TAGS[dtype]
    with SourceIndex(weight_files, weight_format) as index:
        jobs = plan(adapter, norm, tp, pp, index, prefixes, where)
        if not write:
            return norm
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(trtllm_config(adapter, norm, dtype, tp, pp), indent=2))
        layouts: dict[int, list[Planned]] = {r: [] for r in range(tp * pp)}
        for job in jobs:
            for rank, planned in job.per_rank.items():
                layouts[rank].append(planned)
        writers = {r: RankWriter(out / f"rank{r}.safetensors", [(t.name, t.shape) for t in layouts[r]], tag,
                                 page_residue=copy_alignment(layouts[r], tag)) for r in layouts}
        transfers = Transfers(writers)
        collect = gc.isenabled()
        gc.disable()  # no cycles are made here; the collector's passes over the per-block objects cost ~5% (measured)
        try:
            total = 0
            scratch = Scratch()
            for job in jobs:
                transfers.pace()
                total += write_job(job, writers, tag, where, transfers, scratch)
            transfers.finish()  # raises the first failure (a NaN/Inf beside a copy); the caller discards the output
        finally:
            if collect:
                gc.enable()
            transfers.close()
            for w in writers.values():
                w.close()
    timed = ", ".join(f"{way} {rate / 2**30:.2f} GiB/s" for way, rate in transfers.rates.items())
    log(f"wrote {tp * pp} rank file(s), {total / 2**20:.1f} MiB of {dtype} weights"
        + (f"; unchanged rows went {transfers.way} at the end (timed {timed})" if timed else ""))
    return norm


def export(adapter: DecoderAdapter, source: Path, ctx, *, hf_config: Mapping[str, Any] | None = None,
           prefixes: Sequence[str] | None = None) -> Artifact:
    """The export stage: a TensorRT-LLM unified checkpoint in ``ctx.workdir/checkpoint``.

    ``hf_config`` and ``prefixes`` let composite families (a decoder inside a multimodal checkpoint)
    reuse the converter with the inner text config and the inner weight-name prefix.
    """
    from forge.hf import inspect_checkpoint

    from ..profiles import BUILD_FLAGS, parse_version

    spec = ctx.spec
    source = Path(source)
    checkpoint = inspect_checkpoint(source, allow_pickle=spec.allow_pickle,
                                    trust_remote_code=spec.trust_remote_code)
    config = dict(hf_config or checkpoint.config)
    out = ctx.workdir / "checkpoint"
    norm = convert_checkpoint(adapter, config, checkpoint.weight_files, out, dtype=spec.dtype, tp=spec.tp,
                              pp=spec.pp, weight_format=checkpoint.weight_format, prefixes=prefixes,
                              where=str(source), log=ctx.log, write=not ctx.dry_run,
                              uneven_pp=parse_version(spec.backend_version) >= BUILD_FLAGS["uneven_pp"])
    architecture = (config.get("architectures") or [""])[0]
    meta = checkpoint_meta(adapter, norm, architecture, spec.dtype, spec.tp, spec.pp, source)
    ctx.note("export", {"format": "tensorrt-llm unified checkpoint", "architecture": meta["architecture"],
                        "dtype": spec.dtype, "tp": spec.tp, "pp": spec.pp,
                        "tied_lm_head": bool(norm.get("tie_word_embeddings")),
                        "vocab_padded_to": meta["vocab_size_padded"]})
    if ctx.option("parity", False) and not ctx.dry_run:
        check_parity(adapter, source, out, spec.dtype, ctx)
    if ctx.target == "tensorrtllm" and not spec.quant:  # a quantized build checks the quantized checkpoint
        from .loadercheck import check_checkpoint

        check_checkpoint(ctx, out)
    return Artifact(ARTIFACT_KIND, out, meta)


