"""The decoder a ``tensorrt_llm`` model config describes, loaded: the model, its engine, guides and adapters.

One home for what ``model.py`` (the engine inside the python stub) and ``hosted`` (the engine in a process of
its own) both do at load. Nothing here imports Triton.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

try:
    import forge_glue  # beside forge_decoder in the model's version directory
except ImportError:  # forge's own tree (tests)
    from ... import forge_glue

from . import guided
from . import lora as lora_mod
from .request import Limits, RequestError


def parameter(config: dict, key: str, default: str = "") -> str:
    """A model config parameter's string value; ``default`` when unset or an unfilled ``${...}``."""
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return default if value == "" or value.startswith("${") else value


@dataclass
class Loaded:
    """What ``load`` made."""

    engine: Any  # engine.Engine (or the tensor-parallel leader's)
    limits: Limits
    guides: guided.Guides
    loras: lora_mod.AdapterCache | None
    device: Any
    summary: str  # the model, device, dtype, tp and torch threads, for the log line
    graphs: str  # the CUDA-graph decoder's choice (use_graphs)

    def prepare(self, rows: list) -> None:
        """Before a request's rows (GenerationRequest) are submitted: each row's LoRA adapter from its task id /
        weights (tensorrtllm_backend's cache semantics) and its compiled guide; a bad one raises RequestError."""
        if self.loras is not None:
            self.loras.resolve_rows(rows)
        elif any(r.lora_task_id is not None or r.lora_weights is not None for r in rows):
            raise RequestError("this model was built without LoRA modules; leave out lora_task_id / lora_weights")
        self.guides.prepare(rows)


def choose_device(config: dict):
    from .device import choose_device  # not the engine's module: a stub whose engine runs apart needs none of it

    return choose_device(os.environ.get("FORGE_PYTARGET_DEVICE") or parameter(config, "device", "auto"))


def load(config: dict, here: Path, info: Callable[[str], None], warn: Callable[[str], None],
         error: Callable[[str], None], name: str = "tensorrt_llm") -> Loaded:
    """Load the model of ``here`` (the model version's directory) as ``config`` describes it; ``info`` /
    ``warn`` / ``error`` log."""
    weights = here / parameter(config, "weights", "hf")
    forge_glue.skip_vision_libraries(weights)
    import torch

    from . import engine as engine_mod
    from . import native  # its weights without transformers: the engine's side only, as the engine module

    device = choose_device(config)
    dtype = engine_mod.choose_dtype(device, parameter(config, "compute_dtype", "auto"), parameter(config, "dtype", "float16"))
    threads = engine_mod.choose_threads(device, int(os.environ.get("FORGE_PYTARGET_THREADS")
                                                    or parameter(config, "cpu_threads", "0")), dtype)
    torch.set_num_threads(threads)
    tp = int(parameter(config, "tensor_parallel", "1") or 1)
    if tp > 1:  # rank 0 of a tensor-parallel group: the followers join every step of the engine
        from . import distributed

        model, make_engine = distributed.lead(tp, weights, device, dtype, threads)
        how = "transformers"
    else:
        model, how = _single(config, weights, device, dtype, warn)
        make_engine = engine_mod.Engine
    vocab = int(model.get_output_embeddings().weight.shape[0])
    limits = Limits(vocab_size=vocab, hidden_size=int(model.get_input_embeddings().embedding_dim),
                    max_input_len=int(parameter(config, "max_input_len", "1024")),
                    max_seq_len=int(parameter(config, "max_seq_len", "2048")))
    guides = _guides(config, here, weights, threads, limits, info, name)
    rows = engine_mod.choose_rows(device, int(parameter(config, "inflight_sequences", "0") or 0),
                                  int(parameter(config, "max_num_sequences", "") or config.get("max_batch_size") or 8))
    settings = dict(max_rows=rows, max_prefill_tokens=int(parameter(config, "max_num_tokens", "8192")),
                    cancel_check_ms=float(parameter(config, "cancellation_check_period_ms", "100")), log=error)
    reuse = parameter(config, "enable_kv_cache_reuse", "false").lower() in forge_glue.TRUE
    fraction = float(parameter(config, "kv_cache_free_gpu_mem_fraction", "") or 0) or None

    def engine_for(model) -> tuple[Any, Any, str]:
        """The engine of ``model``, its adapter cache (hooked on ``model``'s modules) and its decoder's choice."""
        loras = lora_mod.from_parameters(model, lambda key, default: parameter(config, key, default),
                                         dtype=dtype, device=device, here=here, log=info)
        engine = make_engine(model, limits, **settings)
        engine.lora = None if loras is None else loras.modules
        # tp > 1: every rank builds rank 0's decoder (or, where it is off, repeats rank 0's Hugging Face forward)
        return engine, loras, engine.use_graphs(
            parameter(config, "cuda_graphs", "auto"), compile=parameter(config, "torch_compile", "auto"),
            paged=parameter(config, "paged_kv_cache", "auto"), reuse=reuse, memory_fraction=fraction,
            overlap=parameter(config, "overlap_steps", "auto"))

    engine, loras, graphs = engine_for(model)
    if engine.graphs is None and native.loaded_here(model):  # it has no forward of its own
        warn(f"forge python target {name!r}: the static decoder does not run ({graphs}); loading the model "
             "through transformers for its forward")
        model, how = engine_mod.load_model(weights, device, dtype), "transformers"
        engine, loras, graphs = engine_for(model)
    if (reuse or fraction) and engine.graphs is None:
        warn("-o enable_kv_cache_reuse / kv_cache_free_gpu_mem_fraction have no effect: they apply to the "
             "CUDA-graph decoder, which is off here")
    summary = (f"{type(model).__name__} ({how}) on {device} ({dtype}, tp {tp}, {torch.get_num_threads()} torch "
               f"threads), {rows} sequences in flight")
    return Loaded(engine, limits, guides, loras, device, summary, graphs)


def load_apart(config: dict, here: Path, info: Callable[[str], None], warn: Callable[[str], None],
               error: Callable[[str], None], name: str = "tensorrt_llm") -> Loaded:
    """``load`` on a thread of its own that ends with it.

    torch's OpenMP gives each thread that runs a parallel region a team of workers for as long as that thread
    lives. Loaded on the caller's thread (which lives on) and stepped on the engine's, the model would keep two
    teams, and with more workers than cores libgomp stops them spinning between parallel regions and wakes each
    for every one: on 2 cores a SmolLM2-135M decoding step took 33–40 ms that way against 24 ms.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-load") as pool:  # its thread ends on exit
        return pool.submit(load, config, here, info, warn, error, name).result()


def _guides(config: dict, here: Path, weights: Path, threads: int, limits: Limits, info: Callable[[str], None],
            name: str) -> guided.Guides:
    """Guided decoding with the model's tokenizer: ``tokenizer_dir`` (relative to ``1/``) when set, else the
    weights' directory, else the preprocessing model's ``1/tokenizer`` in this repository."""
    model_dir = here.parent
    prefix = model_dir.name[: -len("tensorrt_llm")] if model_dir.name.endswith("tensorrt_llm") else ""
    candidates = [here / d for d in (parameter(config, "tokenizer_dir"),) if d]
    candidates += [weights, model_dir.parent / f"{prefix}preprocessing" / "1" / "tokenizer"]
    found = next((d for d in candidates if any((d / f).is_file() for f in forge_glue.TOKENIZER_CORE)), None)
    guides = guided.Guides(found, limits.vocab_size, threads=threads)
    reason = guides.unavailable(load=False)  # imported by the first guided request
    info(f"forge python target {name!r}: guided decoding " + (
        f"available (xgrammar {guided.version()}, tokenizer {found})" if reason is None
        else f"unavailable: {reason}; guided requests get an error"))
    return guides


def _single(config: dict, weights: Path, device, dtype, warn: Callable[[str], None]) -> tuple[Any, str]:
    """One rank's model and how it was loaded: its weights alone (``native``) where the static decoder will
    compute its steps, else the transformers model."""
    from . import engine as engine_mod
    from . import native

    checkpoint = native.read_config(weights)
    reason = ("-o cuda_graphs=false runs the transformers forward"
              if parameter(config, "cuda_graphs", "auto").lower() == "false" else native.why_not(checkpoint))
    if reason is None:
        try:
            return native.load(weights, device, dtype, checkpoint), "weights loaded by forge"
        except Exception as exc:  # noqa: BLE001 - transformers then loads it, or says what is wrong with it
            warn(f"forge decoder: loading the weights through transformers: {type(exc).__name__}: {exc}")
    return engine_mod.load_model(weights, device, dtype), "transformers"
