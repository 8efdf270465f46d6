"""tensorrtllm_backend releases as data: the tensors, parameters and container of each version.

Each :class:`Release` row lists what changed against the row before it (tensors added, dropped,
retyped or renamed; parameters added, dropped or given new defaults). Folding the rows from the
oldest gives the complete :class:`Profile` of every version, so supporting a new backend release
means adding one row at the end of ``RELEASES``.

The facts come from ``all_models/inflight_batcher_llm/*/config.pbtxt`` of
triton-inference-server/tensorrtllm_backend at each tag (v0.5.0 … v0.19.0) and of
NVIDIA/TensorRT-LLM ``triton_backend/`` for v1.0.0, and from the backend's documented defaults.

Tensor routing is part of the data: an input ``feed`` names the ensemble input that feeds it,
``src`` the ``model.output`` that produces it; an output ``out`` names the ensemble output it
becomes. The ensemble of a profile is therefore derived, never listed twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from ..errors import UsageError

# The four models of an inflight_batcher_llm repository (the ensemble is derived from routes).
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")

# Data types a build decides (engine logits dtype, model dtype) instead of the template.
LOGITS = "$logits"
PROMPT_TABLE = "$prompt_table"
ENCODER_FEATURES = "$encoder_features"


@dataclass(frozen=True)
class Tensor:
    """One input or output of a model, with its route inside the ensemble."""

    name: str
    dtype: str  # Triton type without TYPE_ ("INT32"), or one of LOGITS/PROMPT_TABLE/ENCODER_FEATURES
    dims: tuple[int, ...]
    output: bool = False
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    ragged: bool = False
    feed: str | None = None  # inputs: the ensemble input that feeds this tensor
    src: str | None = None  # inputs: "model.OUTPUT" that produces this tensor
    out: str | None = None  # outputs: the ensemble output this tensor becomes
    multimodal: bool = False  # image/video tensors; forge's text models leave them out
    feed_dims: tuple[int, ...] | None = None  # dims of the ensemble input when narrower than ``dims``


@dataclass(frozen=True)
class Parameter:
    """A ``parameters`` entry of a model config and the ``-o`` option that sets it."""

    key: str
    model: str = "tensorrt_llm"
    option: str = ""  # the -o name (tensorrtllm_backend's fill_template variable); "" = key
    default: str | None = None  # documented default, written when no -o is given; None: not written
    kind: str = "str"  # str, bool, int, float: how a -o value is checked
    choices: tuple[str, ...] = ()
    fixed: bool = False  # forge always writes ``default``; no -o can change it
    deprecated: tuple[str, ...] = ()  # values that still work but the backend deprecated
    help: str = ""

    @property
    def name(self) -> str:
        """The ``-o`` option name."""
        return self.option or self.key


@dataclass(frozen=True)
class Interface:
    inputs: tuple[Tensor, ...] = ()
    outputs: tuple[Tensor, ...] = ()

    def input(self, name: str) -> Tensor | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> Tensor | None:
        return next((t for t in self.outputs if t.name == name), None)


@dataclass(frozen=True)
class Profile:
    """Everything forge needs to emit repositories for one tensorrtllm_backend version."""

    version: str  # "v0.13.0"
    triton: str  # NGC release of the matching tritonserver trtllm container, "24.09"
    models: tuple[tuple[str, Interface], ...]
    parameters: tuple[Parameter, ...]
    dynamic_batching: frozenset[str]  # models whose template enables dynamic_batching
    aliases: tuple[str, ...] = ()  # other NGC releases that ship this backend version
    notes: str = ""

    @property
    def container(self) -> str:
        """The NGC image ``forge serve --docker`` runs for this profile."""
        return f"nvcr.io/nvidia/tritonserver:{self.triton}-trtllm-python-py3"

    def interface(self, model: str) -> Interface:
        """The tensors of ``model`` (one of MODELS); empty when the version lacks the model."""
        return dict(self.models).get(model, Interface())

    def has_model(self, model: str) -> bool:
        return model in dict(self.models)

    def params(self, model: str) -> tuple[Parameter, ...]:
        return tuple(p for p in self.parameters if p.model == model)

    def parameter(self, model: str, key: str) -> Parameter | None:
        return next((p for p in self.parameters if p.model == model and p.key == key), None)


# -- edits: how one release differs from the one before ----------------------------------------

@dataclass(frozen=True)
class Add:
    model: str
    tensor: Tensor


@dataclass(frozen=True)
class Drop:
    path: str  # "model.in.NAME" or "model.out.NAME"


@dataclass(frozen=True)
class Change:
    path: str
    fields: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Rename:
    path: str
    new: str
    feed: bool = True  # rename the ensemble tensor too when it had the same name


@dataclass(frozen=True)
class SetParam:
    parameter: Parameter


@dataclass(frozen=True)
class DropParam:
    model: str
    key: str


@dataclass(frozen=True)
class Batching:
    model: str
    enabled: bool


@dataclass(frozen=True)
class Release:
    """One row of the table: a backend version, its container, and what changed."""

    version: str
    triton: str
    changes: tuple[Any, ...] = ()
    aliases: tuple[str, ...] = ()
    notes: str = ""


# -- a small vocabulary to keep the rows readable ---------------------------------------------

def i(name: str, dtype: str, *dims: int, opt: bool = False, scalar: bool = False,
      ragged: bool = False, feed: str | bool | None = None, src: str | None = None,
      mm: bool = False, feed_dims: tuple[int, ...] | None = None) -> Tensor:
    """An input; ``scalar`` adds ``reshape: { shape: [ ] }``; ``feed=True`` feeds it by its own name."""
    return Tensor(name, dtype, tuple(dims), optional=opt, reshape=() if scalar else None,
                  ragged=ragged, feed=name if feed is True else feed, src=src, multimodal=mm,
                  feed_dims=feed_dims)


def o(name: str, dtype: str, *dims: int, out: str | bool | None = None, mm: bool = False) -> Tensor:
    """An output; ``out=True`` makes it the ensemble output of the same name."""
    return Tensor(name, dtype, tuple(dims), output=True, out=name if out is True else out,
                  multimodal=mm)


def add(model: str, *tensors: Tensor) -> tuple[Add, ...]:
    return tuple(Add(model, t) for t in tensors)


def drop(*paths: str) -> tuple[Drop, ...]:
    return tuple(Drop(p) for p in paths)


def change(*paths: str, **fields: Any) -> tuple[Change, ...]:
    if "dims" in fields:
        fields["dims"] = tuple(fields["dims"])
    if fields.pop("scalar", False):
        fields["reshape"] = ()
    return tuple(Change(p, tuple(sorted(fields.items()))) for p in paths)


def param(key: str, default: Any = None, *, model: str = "tensorrt_llm", **kw: Any) -> SetParam:
    if isinstance(default, bool):
        default = "true" if default else "false"
    return SetParam(Parameter(key, model=model, default=None if default is None else str(default), **kw))


def flag(key: str, default: bool | None, **kw: Any) -> SetParam:
    return param(key, default, kind="bool", **kw)


def number(key: str, default: Any = None, *, kind: str = "int", **kw: Any) -> SetParam:
    return param(key, default, kind=kind, **kw)


BATCHING = ("inflight_fused_batching", "inflight_batching", "V1")
SCHEDULER = ("guaranteed_no_evict", "max_utilization")
IMAGE_WORKER = "/opt/tritonserver/backends/tensorrtllm"

# -- the table ----------------------------------------------------------------------------------

V0_5_0 = (
    add("preprocessing",
        i("QUERY", "STRING", -1, feed="text_input"),
        i("BAD_WORDS_DICT", "STRING", -1, feed="bad_words"),
        i("STOP_WORDS_DICT", "STRING", -1, feed="stop_words"),
        i("REQUEST_OUTPUT_LEN", "UINT32", -1, feed="max_tokens"),
        o("INPUT_ID", "INT32", -1),
        o("REQUEST_INPUT_LEN", "INT32", 1),
        o("BAD_WORDS_IDS", "INT32", 2, -1),
        o("STOP_WORDS_IDS", "INT32", 2, -1),
        o("REQUEST_OUTPUT_LEN", "UINT32", -1)),
    add("tensorrt_llm",
        i("input_ids", "INT32", -1, src="preprocessing.INPUT_ID"),
        i("input_lengths", "INT32", 1, scalar=True, src="preprocessing.REQUEST_INPUT_LEN"),
        i("request_output_len", "UINT32", 1, src="preprocessing.REQUEST_OUTPUT_LEN"),
        i("end_id", "UINT32", 1, opt=True, scalar=True, feed=True),
        i("pad_id", "UINT32", 1, opt=True, scalar=True, feed=True),
        i("beam_width", "UINT32", 1, opt=True, scalar=True, feed=True),
        i("temperature", "FP32", 1, opt=True, scalar=True, feed=True),
        i("runtime_top_k", "UINT32", 1, opt=True, scalar=True, feed="top_k"),
        i("runtime_top_p", "FP32", 1, opt=True, scalar=True, feed="top_p"),
        i("len_penalty", "FP32", 1, opt=True, scalar=True, feed="length_penalty"),
        i("repetition_penalty", "FP32", 1, opt=True, scalar=True, feed=True),
        i("min_length", "UINT32", 1, opt=True, scalar=True, feed=True),
        i("presence_penalty", "FP32", 1, opt=True, scalar=True, feed=True),
        i("random_seed", "UINT64", 1, opt=True, scalar=True, feed=True),
        i("stop", "BOOL", 1, opt=True),
        i("streaming", "BOOL", 1, opt=True, feed="stream"),
        o("output_ids", "INT32", -1, -1)),
    add("postprocessing",
        i("TOKENS_BATCH", "INT32", -1, -1, src="tensorrt_llm.output_ids"),
        o("OUTPUT", "STRING", -1, -1, out="text_output")),
    param("FORCE_CPU_ONLY_INPUT_TENSORS", "no", fixed=True),
    param("gpt_model_type", "inflight_fused_batching", option="batching_strategy", choices=BATCHING,
          help="inflight_fused_batching for in-flight batching, V1 for static batching"),
    param("gpt_model_path", option="engine_dir",
          help="engine directory as the server sees it (default: the repository's tensorrt_llm/1)"),
    number("max_beam_width", help="default: --max-beam-width"),
    number("max_tokens_in_paged_kv_cache", help="KV-cache size in tokens (default: unlimited)"),
    # 0.5.0 called the no-evict policy guaranteed_completion (seed 000 sets it); renamed in 0.6.1
    param("batch_scheduler_policy", "guaranteed_completion", choices=("guaranteed_completion", "max_utilization")),
    number("kv_cache_free_gpu_mem_fraction", 0.85, kind="float",
           help="fraction of free GPU memory the KV cache may take"),
    number("max_num_sequences", help="default: the engine's max batch size"),
    flag("enable_trt_overlap", True),
    param("tokenizer_dir", model="preprocessing", fixed=True),  # forge: the repository's own copy
    param("tokenizer_dir", model="postprocessing", fixed=True),
    param("tokenizer_type", "auto", model="preprocessing", fixed=True),
    param("tokenizer_type", "auto", model="postprocessing", fixed=True),
)

#: trtllm-build's flag history (and the checkpoint layout it reads): feature → first release that has it.
BUILD_FLAGS: Mapping[str, tuple[int, int]] = {
    "trtllm_build": (0, 8),  # trtllm-build and the unified checkpoint first shipped here
    "paged_context_fmha": (0, 9),  # --use_paged_context_fmha
    "max_seq_len": (0, 11),  # --max_seq_len replaced --max_output_len
    "multiple_profiles": (0, 11),  # --multiple_profiles
    # pipeline stages with unequal layer counts: TensorRT-LLM 0.16's Mapping.pp_layers (read in its source)
    # still gives every stage num_layers // pp and drops the rest; later releases split with
    # torch.tensor_split (first stages take the extra layers). The release that switched is not
    # pinned down here, so uneven splits are allowed from 1.0 on and refused before.
    "uneven_pp": (1, 0),
    "kv_cache_type": (1, 0),  # --kv_cache_type paged supersedes --paged_kv_cache enable
    # --lora_dir / --lora_target_modules / --max_lora_rank: in trtllm-build from 0.9 (the 0.8 LoRA recipe
    # passed them to the model's build script); seen in tensorrtllm_backend v0.10.0's LoRA recipe and in
    # TensorRT-LLM 0.16's argparse, the 0.9 boundary itself is not read from a 0.9 source
    "lora_dir": (0, 9),
    # prompt-table rows (multimodal): --max_prompt_embedding_table_size since trtllm-build; the backend's
    # multimodal docs (v0.12.0 on) use its alias --max_multimodal_len
    "max_multimodal_len": (0, 12),
}
_NEWEST_FLAGS = (99, 0, 0)  # no --backend-version: the newest flag set


def parse_version(text: str | None) -> tuple[int, int, int]:
    """``"v0.13.0"`` → (0, 13, 0); None → the newest flag set."""
    if text is None:
        return _NEWEST_FLAGS
    match = re.fullmatch(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.-]?\w*)?", text.strip())
    if not match:
        raise UsageError(f"cannot read --backend-version {text!r}; write it like v0.13.0")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


RELEASES: tuple[Release, ...] = (
    Release("v0.5.0", "23.10", V0_5_0, notes="first release; UINT32 lengths and ids"),
    Release("v0.6.1", "23.11", (
        change("preprocessing.in.BAD_WORDS_DICT", "preprocessing.in.STOP_WORDS_DICT", optional=True),
        add("preprocessing",
            i("EMBEDDING_BIAS_WORDS", "STRING", -1, opt=True, feed="embedding_bias_words"),
            i("EMBEDDING_BIAS_WEIGHTS", "FP32", -1, opt=True, feed="embedding_bias_weights"),
            o("EMBEDDING_BIAS", "FP32", -1)),
        change("tensorrt_llm.in.input_ids", ragged=True),
        add("tensorrt_llm",
            i("stop_words_list", "INT32", 2, -1, opt=True, ragged=True, src="preprocessing.STOP_WORDS_IDS"),
            i("bad_words_list", "INT32", 2, -1, opt=True, ragged=True, src="preprocessing.BAD_WORDS_IDS"),
            i("embedding_bias", "FP32", -1, opt=True, ragged=True, src="preprocessing.EMBEDDING_BIAS"),
            i("return_log_probs", "BOOL", 1, opt=True, scalar=True, feed=True),
            i("prompt_embedding_table", "FP16", -1, -1, opt=True, ragged=True, feed=True),
            i("prompt_vocab_size", "UINT32", 1, opt=True, scalar=True, feed=True),
            o("sequence_length", "INT32", -1),
            o("cum_log_probs", "FP32", -1),
            o("output_log_probs", "FP32", -1, -1)),
        add("postprocessing",
            i("SEQUENCE_LENGTH", "INT32", -1, src="tensorrt_llm.sequence_length"),
            i("CUM_LOG_PROBS", "FP32", -1, src="tensorrt_llm.cum_log_probs"),
            i("OUTPUT_LOG_PROBS", "FP32", -1, -1, src="tensorrt_llm.output_log_probs"),
            o("OUT_CUM_LOG_PROBS", "FP32", -1, out="cum_log_probs"),
            o("OUT_OUTPUT_LOG_PROBS", "FP32", -1, -1, out="output_log_probs")),
        change("postprocessing.out.OUTPUT", dims=(-1,)),
        flag("exclude_input_in_output", False,
             help="return only generated tokens, not the prompt"),
        param("batch_scheduler_policy", "guaranteed_no_evict", choices=SCHEDULER),
        number("max_kv_cache_length"),
        Batching("tensorrt_llm", True),
    ), notes="stop/bad words and embedding bias reach tensorrt_llm; log probs; dynamic batching"),
    Release("v0.7.1", "24.01", (
        change("preprocessing.in.REQUEST_OUTPUT_LEN", "preprocessing.out.REQUEST_OUTPUT_LEN",
               "tensorrt_llm.in.request_output_len", "tensorrt_llm.in.end_id", "tensorrt_llm.in.pad_id",
               "tensorrt_llm.in.beam_width", "tensorrt_llm.in.runtime_top_k", "tensorrt_llm.in.min_length",
               "tensorrt_llm.in.prompt_vocab_size", dtype="INT32"),
        add("tensorrt_llm", i("draft_input_ids", "INT32", -1, opt=True, ragged=True)),
        DropParam("tensorrt_llm", "max_kv_cache_length"),
        flag("enable_kv_cache_reuse", False),
        number("max_attention_window_size", help="default: the engine's max sequence length"),
        flag("add_special_tokens", False, model="preprocessing"),
        flag("skip_special_tokens", True, model="postprocessing"),
        add("tensorrt_llm_bls",
            i("text_input", "STRING", -1),
            i("max_tokens", "INT32", -1),
            i("bad_words", "STRING", -1, opt=True),
            i("stop_words", "STRING", -1, opt=True),
            i("end_id", "INT32", 1, opt=True),
            i("pad_id", "INT32", 1, opt=True),
            i("top_k", "INT32", 1, opt=True),
            i("top_p", "FP32", 1, opt=True),
            i("temperature", "FP32", 1, opt=True),
            i("length_penalty", "FP32", 1, opt=True),
            i("repetition_penalty", "FP32", 1, opt=True),
            i("min_length", "INT32", 1, opt=True),
            i("presence_penalty", "FP32", 1, opt=True),
            i("random_seed", "UINT64", 1, opt=True),
            i("return_log_probs", "BOOL", 1, opt=True),
            i("beam_width", "INT32", 1, opt=True),
            i("stream", "BOOL", 1, opt=True),
            i("prompt_embedding_table", "FP16", -1, -1, opt=True),
            i("prompt_vocab_size", "INT32", 1, opt=True),
            i("embedding_bias_words", "STRING", -1, opt=True),
            i("embedding_bias_weights", "FP32", -1, opt=True),
            o("text_output", "STRING", -1),
            o("cum_log_probs", "FP32", -1),
            o("output_log_probs", "FP32", -1, -1)),
        flag("accumulate_tokens", False, model="tensorrt_llm_bls",
             help="streaming BLS: detokenize all tokens so far on every step"),
    ), notes="UINT32 → INT32 for lengths and ids; tensorrt_llm_bls added"),
    Release("v0.8.0", "24.02", (
        add("preprocessing",
            # The ensemble declares end_id/pad_id as [1]; the template's preprocessing takes [-1].
            i("END_ID", "INT32", -1, opt=True, feed="end_id", feed_dims=(1,)),
            i("PAD_ID", "INT32", -1, opt=True, feed="pad_id", feed_dims=(1,)),
            o("OUT_END_ID", "INT32", -1),
            o("OUT_PAD_ID", "INT32", -1)),
        change("tensorrt_llm.in.end_id", feed=None, src="preprocessing.OUT_END_ID"),
        change("tensorrt_llm.in.pad_id", feed=None, src="preprocessing.OUT_PAD_ID"),
        add("tensorrt_llm",
            i("frequency_penalty", "FP32", 1, opt=True, scalar=True, feed=True),
            i("return_context_logits", "BOOL", 1, opt=True, scalar=True, feed=True),
            i("return_generation_logits", "BOOL", 1, opt=True, scalar=True, feed=True),
            i("lora_weights", "FP16", -1, -1, opt=True, ragged=True),
            i("lora_config", "INT32", -1, 3, opt=True, ragged=True),
            o("context_logits", "FP32", -1, -1),
            o("generation_logits", "FP32", -1, -1, -1)),
        add("postprocessing",
            i("CONTEXT_LOGITS", "FP32", -1, -1, opt=True, src="tensorrt_llm.context_logits"),
            i("GENERATION_LOGITS", "FP32", -1, -1, -1, opt=True, src="tensorrt_llm.generation_logits"),
            o("OUT_CONTEXT_LOGITS", "FP32", -1, -1, out="context_logits"),
            o("OUT_GENERATION_LOGITS", "FP32", -1, -1, -1, out="generation_logits")),
        add("tensorrt_llm_bls",
            i("frequency_penalty", "FP32", 1, opt=True),
            i("return_context_logits", "BOOL", 1, opt=True, scalar=True),
            i("return_generation_logits", "BOOL", 1, opt=True, scalar=True),
            o("context_logits", "FP32", -1, -1),
            o("generation_logits", "FP32", -1, -1, -1)),
        DropParam("tensorrt_llm", "max_num_sequences"),
        flag("normalize_log_probs", True),
        flag("enable_chunked_context", False),
        param("gpu_device_ids", help="comma-separated GPU ids (default: all visible)"),
        number("kv_cache_free_gpu_mem_fraction", 0.9, kind="float",
               help="fraction of free GPU memory the KV cache may take"),
        flag("enable_trt_overlap", False),
    ), notes="end/pad ids default to the tokenizer's; context and generation logits; LoRA"),
    Release("v0.9.0", "24.05", (
        change("tensorrt_llm_bls.in.return_log_probs", scalar=True),
        add("tensorrt_llm",
            i("draft_logits", "FP32", -1, -1, opt=True, ragged=True),
            i("lora_task_id", "UINT64", 1, opt=True, scalar=True)),
        change("postprocessing.in.CUM_LOG_PROBS", "postprocessing.in.OUTPUT_LOG_PROBS", optional=True),
        add("tensorrt_llm_bls",
            i("num_draft_tokens", "INT32", 1, opt=True),
            i("use_draft_logits", "BOOL", 1, opt=True, scalar=True)),
        DropParam("preprocessing", "tokenizer_type"),
        DropParam("postprocessing", "tokenizer_type"),
        param("decoding_mode", choices=("top_k", "top_p", "top_k_top_p", "beam_search", "medusa"),
              help="default: top_k_top_p, or beam_search when max_beam_width > 1"),
        param("medusa_choices"),
        number("lora_cache_optimal_adapter_size", 8),
        number("lora_cache_max_adapter_size", 64),
        number("lora_cache_gpu_memory_fraction", 0.05, kind="float"),
        number("lora_cache_host_memory_bytes", 1 << 30),
        param("worker_path", f"{IMAGE_WORKER}/triton_tensorrtllm_worker", fixed=True),
        param("tensorrt_llm_model_name", model="tensorrt_llm_bls", fixed=True),
        param("tensorrt_llm_draft_model_name", model="tensorrt_llm_bls"),
    ), notes="tokenizer_type removed; LoRA task ids; draft models in the BLS"),
    Release("v0.10.0", "24.06", (
        add("tensorrt_llm",
            i("draft_acceptance_threshold", "FP32", 1, opt=True, scalar=True),
            i("runtime_top_p_min", "FP32", 1, opt=True, scalar=True),
            i("runtime_top_p_decay", "FP32", 1, opt=True, scalar=True),
            i("runtime_top_p_reset_ids", "INT32", 1, opt=True, scalar=True),
            i("early_stopping", "BOOL", 1, opt=True, scalar=True),
            i("beam_search_diversity_rate", "FP32", 1, opt=True, scalar=True)),
        DropParam("tensorrt_llm", "worker_path"),
        DropParam("tensorrt_llm", "enable_trt_overlap"),
        param("executor_worker_path", f"{IMAGE_WORKER}/trtllmExecutorWorker", fixed=True),
        # V1 still parses, but TensorRT-LLM 0.10 deprecated static batching (TrtGptModelV1).
        param("gpt_model_type", "inflight_fused_batching", option="batching_strategy",
              choices=BATCHING, deprecated=("V1",),
              help="inflight_fused_batching for in-flight batching, V1 for static batching"),
        number("kv_cache_host_memory_bytes", help="offload KV-cache blocks to this much host memory"),
        flag("kv_cache_onboard_blocks", None),
        number("sink_token_length"),
        number("cancellation_check_period_ms", 100),
        number("stats_check_period_ms", 100),
        number("iter_stats_max_iterations"),
        number("request_stats_max_iterations"),
        number("gpu_weights_percent", 1.0, kind="float"),
        flag("add_special_tokens", True, model="preprocessing"),
    ), notes="executor API; enable_trt_overlap removed; V1 batching deprecated"),
    Release("v0.11.0", "24.07", (
        add("preprocessing",
            i("DECODER_QUERY", "STRING", -1, opt=True, feed="decoder_text_input"),
            o("DECODER_INPUT_ID", "INT32", -1),
            o("REQUEST_DECODER_INPUT_LEN", "INT32", 1)),
        add("tensorrt_llm",
            i("decoder_input_ids", "INT32", -1, opt=True, ragged=True, src="preprocessing.DECODER_INPUT_ID"),
            i("decoder_input_lengths", "INT32", 1, opt=True, scalar=True,
              src="preprocessing.REQUEST_DECODER_INPUT_LEN")),
        add("tensorrt_llm_bls", i("decoder_text_input", "STRING", -1, opt=True)),
        param("encoder_model_path", option="encoder_engine_dir"),
        flag("skip_special_tokens", True, model="postprocessing"),
    ), notes="encoder-decoder inputs"),
    Release("v0.12.0", "24.08", (
        change("preprocessing.in.QUERY", "preprocessing.in.DECODER_QUERY", "preprocessing.in.REQUEST_OUTPUT_LEN",
               "preprocessing.in.END_ID", "preprocessing.in.PAD_ID", "preprocessing.out.OUT_END_ID",
               "preprocessing.out.OUT_PAD_ID", "tensorrt_llm_bls.in.text_input",
               "tensorrt_llm_bls.in.decoder_text_input", "tensorrt_llm_bls.in.max_tokens", dims=(1,)),
        add("preprocessing",
            i("IMAGE", "FP16", 3, 224, 224, opt=True, feed="image_input", mm=True),
            i("PROMPT_EMBEDDING_TABLE", "FP16", -1, -1, opt=True, ragged=True, feed="prompt_embedding_table"),
            o("OUT_PROMPT_EMBEDDING_TABLE", "FP16", -1, -1)),
        change("tensorrt_llm.in.prompt_embedding_table", feed=None,
               src="preprocessing.OUT_PROMPT_EMBEDDING_TABLE"),
        change("tensorrt_llm.in.request_output_len", "tensorrt_llm.in.stop", "tensorrt_llm.in.streaming",
               scalar=True),
        add("tensorrt_llm", o("batch_index", "INT32", 1)),
        add("postprocessing",
            i("BATCH_INDEX", "INT32", 1, opt=True, src="tensorrt_llm.batch_index"),
            o("OUT_BATCH_INDEX", "INT32", 1, out="batch_index")),
        add("tensorrt_llm_bls",
            i("image_input", "FP16", 3, 224, 224, opt=True, mm=True),
            o("batch_index", "INT32", 1)),
        param("visual_model_path", model="preprocessing"),
        param("gpt_model_path", model="preprocessing", option="engine_dir"),
        flag("multi_block_mode", None),
        flag("enable_context_fmha_fp32_acc", None),
    ), notes="text_input, max_tokens and ids: dims [-1] → [1]"),
    Release("v0.13.0", "24.09", (
        drop("preprocessing.in.IMAGE", "preprocessing.in.PROMPT_EMBEDDING_TABLE",
             "preprocessing.out.OUT_PROMPT_EMBEDDING_TABLE"),
        add("preprocessing",
            i("PROMPT_TABLE_EXTRA_ID", "UINT64", 1, opt=True, feed="prompt_table_extra_id"),
            o("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", -1)),
        change("tensorrt_llm.in.prompt_embedding_table", feed="prompt_embedding_table", src=None),
        add("tensorrt_llm",
            i("prompt_table_extra_ids", "UINT64", -1, opt=True, ragged=True,
              src="preprocessing.OUT_PROMPT_TABLE_EXTRA_IDS")),
        change("tensorrt_llm_bls.in.image_input", dims=(3, -1, -1)),
        add("tensorrt_llm_bls", i("prompt_table_extra_id", "UINT64", 1, opt=True)),
        param("participant_ids"),
        param("multimodal_encoders_name", model="tensorrt_llm_bls"),
        Batching("postprocessing", True),
    ), notes="prompt-table extra ids for KV-cache reuse"),
    Release("v0.14.0", "24.10", (
        add("tensorrt_llm",
            i("num_return_sequences", "INT32", 1, opt=True, scalar=True, feed=True),
            i("exclude_input_in_output", "BOOL", 1, opt=True, scalar=True),
            i("context_phase_params", "UINT8", -1, opt=True, ragged=True),
            o("sequence_index", "INT32", 1, out=True),
            o("context_phase_params", "UINT8", -1)),
        # Log probs, logits and batch index leave tensorrt_llm directly; postprocessing only decodes.
        drop("postprocessing.in.CUM_LOG_PROBS", "postprocessing.in.OUTPUT_LOG_PROBS",
             "postprocessing.in.CONTEXT_LOGITS", "postprocessing.in.GENERATION_LOGITS",
             "postprocessing.in.BATCH_INDEX", "postprocessing.out.OUT_CUM_LOG_PROBS",
             "postprocessing.out.OUT_OUTPUT_LOG_PROBS", "postprocessing.out.OUT_CONTEXT_LOGITS",
             "postprocessing.out.OUT_GENERATION_LOGITS", "postprocessing.out.OUT_BATCH_INDEX"),
        change("tensorrt_llm.out.cum_log_probs", out="cum_log_probs"),
        change("tensorrt_llm.out.output_log_probs", out="output_log_probs"),
        change("tensorrt_llm.out.context_logits", out="context_logits"),
        change("tensorrt_llm.out.generation_logits", out="generation_logits"),
        change("tensorrt_llm.out.batch_index", out="batch_index"),
        add("tensorrt_llm_bls",
            i("num_return_sequences", "INT32", 1, opt=True, scalar=True),
            o("sequence_index", "INT32", 1)),
        number("cross_kv_cache_fraction", kind="float"),
    ), notes="num_return_sequences; disaggregated context phase"),
    Release("v0.15.0", "24.11", (
        add("preprocessing",
            i("IMAGE_BYTES", "UINT8", -1, -1, -1, -1, opt=True, mm=True),
            i("IMAGE_URL", "STRING", 1, opt=True, mm=True),
            o("PIXEL_VALUES", "FP16", -1, -1, -1, -1, mm=True),
            o("ASPECT_RATIO_IDS", "INT64", -1, mm=True),
            o("ASPECT_RATIO_MASK", "INT64", -1, -1, mm=True),
            o("CROSS_ATTENTION_MASK", "INT64", -1, -1, -1, mm=True)),
        change("tensorrt_llm.in.input_ids", optional=True),
        add("tensorrt_llm",
            i("encoder_input_features", ENCODER_FEATURES, -1, -1, opt=True, ragged=True),
            i("encoder_output_lengths", "INT32", 1, opt=True, scalar=True),
            i("cross_attention_mask", "BOOL", -1, -1, opt=True, ragged=True)),
        change("tensorrt_llm.in.lora_task_id", feed=True),
        change("tensorrt_llm.in.lora_weights", feed="lora_weights"),
        change("tensorrt_llm.in.lora_config", feed="lora_config"),
        change("tensorrt_llm_bls.in.image_input", dims=(-1, 3, -1, -1)),
        add("tensorrt_llm_bls",
            i("lora_task_id", "UINT64", 1, opt=True, scalar=True),
            i("lora_weights", "FP16", -1, -1, opt=True, ragged=True),
            i("lora_config", "INT32", -1, 3, opt=True, ragged=True)),
        param("max_num_images", model="preprocessing"),
        flag("speculative_decoding_fast_logits", None),
        flag("cuda_graph_mode", None),
        number("cuda_graph_cache_size"),
    ), notes="LoRA inputs on the ensemble; mllama inputs"),
    Release("v0.16.0", "24.12", (
        add("preprocessing",
            i("VIDEO_BYTES", "UINT8", -1, -1, -1, -1, opt=True, mm=True),
            o("IMAGE_SIZES", "INT64", 2, mm=True),
            o("IS_VIDEO_INPUT", "BOOL", 1, mm=True)),
        change("tensorrt_llm.in.exclude_input_in_output", feed=True),
        add("tensorrt_llm",
            i("return_kv_cache_reuse_stats", "BOOL", 1, opt=True, scalar=True, feed=True),
            i("skip_cross_attn_blocks", "BOOL", 1, opt=True, ragged=True),
            o("kv_cache_alloc_new_blocks", "INT32", 1, out=True),
            o("kv_cache_reused_blocks", "INT32", 1, out=True),
            o("kv_cache_alloc_total_blocks", "INT32", 1, out=True)),
        add("tensorrt_llm_bls",
            i("image_bytes_input", "UINT8", -1, -1, -1, -1, opt=True, mm=True),
            i("image_url_input", "STRING", 1, opt=True, mm=True),
            i("video_bytes_input", "UINT8", -1, -1, -1, -1, opt=True, mm=True),
            i("exclude_input_in_output", "BOOL", 1, opt=True),
            i("return_kv_cache_reuse_stats", "BOOL", 1, opt=True, scalar=True),
            o("kv_cache_alloc_new_blocks", "INT32", 1),
            o("kv_cache_reused_blocks", "INT32", 1),
            o("kv_cache_alloc_total_blocks", "INT32", 1)),
        param("eagle_choices"),
    ), notes="per-request exclude_input_in_output; KV-cache reuse stats"),
    Release("v0.17.0", "25.01", (
        change("tensorrt_llm.in.draft_logits", "tensorrt_llm.out.context_logits",
               "tensorrt_llm.out.generation_logits", "tensorrt_llm_bls.out.context_logits",
               "tensorrt_llm_bls.out.generation_logits", dtype=LOGITS),
        add("tensorrt_llm",
            i("retention_token_range_starts", "INT32", -1, opt=True, ragged=True),
            i("retention_token_range_ends", "INT32", -1, opt=True, ragged=True),
            i("retention_token_range_priorities", "INT32", -1, opt=True, ragged=True),
            i("retention_token_range_durations_ms", "INT32", -1, opt=True, ragged=True),
            i("retention_decode_priority", "INT32", 1, opt=True, ragged=True),
            i("retention_decode_duration_ms", "INT32", 1, opt=True, ragged=True)),
    ), notes="logits dtype follows the engine; KV-cache retention"),
    Release("v0.19.0", "25.05", (
        Rename("tensorrt_llm.in.return_kv_cache_reuse_stats", "return_perf_metrics"),
        Rename("tensorrt_llm_bls.in.return_kv_cache_reuse_stats", "return_perf_metrics"),
        add("preprocessing",
            o("ATTENTION_MASK", "INT64", -1, mm=True),
            o("IMAGE_GRID_THW", "INT64", 3, mm=True),
            o("VISION_INPUT_ID", "INT32", -1, mm=True)),
        add("tensorrt_llm",
            i("mrope_rotary_cos_sin", "FP32", -1, opt=True),
            i("mrope_position_deltas", "INT64", 1, opt=True),
            i("guided_decoding_guide_type", "STRING", 1, opt=True, ragged=True, feed=True),
            i("guided_decoding_guide", "STRING", 1, opt=True, ragged=True, feed=True),
            i("lookahead_window_size", "INT32", 1, opt=True, ragged=True),
            i("lookahead_ngram_size", "INT32", 1, opt=True, ragged=True),
            i("lookahead_verification_set_size", "INT32", 1, opt=True, ragged=True),
            o("arrival_time_ns", "INT64", 1, out=True),
            o("first_scheduled_time_ns", "INT64", 1, out=True),
            o("first_token_time_ns", "INT64", 1, out=True),
            o("last_token_time_ns", "INT64", 1, out=True),
            o("acceptance_rate", "FP32", 1, out=True),
            o("total_accepted_draft_tokens", "INT32", 1, out=True),
            o("total_draft_tokens", "INT32", 1, out=True)),
        add("tensorrt_llm_bls",
            i("guided_decoding_guide_type", "STRING", 1, opt=True),
            i("guided_decoding_guide", "STRING", 1, opt=True),
            o("arrival_time_ns", "INT64", 1),
            o("first_scheduled_time_ns", "INT64", 1),
            o("first_token_time_ns", "INT64", 1),
            o("last_token_time_ns", "INT64", 1),
            o("acceptance_rate", "FP32", 1),
            o("total_accepted_draft_tokens", "INT32", 1),
            o("total_draft_tokens", "INT32", 1)),
        DropParam("preprocessing", "visual_model_path"),
        param("multimodal_model_path", model="preprocessing"),
        flag("enable_kv_cache_reuse", True),
        number("lookahead_window_size"),
        number("lookahead_ngram_size"),
        number("lookahead_verification_set_size"),
        param("lora_prefetch_dir"),
        param("tokenizer_dir", help="tokenizer for guided decoding (as the server sees it)"),
        param("guided_decoding_backend", choices=("xgrammar",)),
        param("xgrammar_tokenizer_info_path"),
        number("num_nodes"),
        Batching("preprocessing", True),
    ), notes="return_kv_cache_reuse_stats → return_perf_metrics; guided decoding; KV-cache reuse on"),
    Release("v1.0.0", "25.09", (
        Rename("tensorrt_llm.in.min_length", "min_tokens"),
        Rename("tensorrt_llm.in.random_seed", "seed"),
        Rename("tensorrt_llm_bls.in.min_length", "min_tokens"),
        Rename("tensorrt_llm_bls.in.random_seed", "seed"),
        change("tensorrt_llm.in.prompt_embedding_table", dtype=PROMPT_TABLE),
        add("preprocessing", i("IMAGES", "STRING", -1, opt=True, mm=True)),
        change("preprocessing.out.IMAGE_SIZES", dims=(-1, 2)),
        add("tensorrt_llm",
            i("return_num_input_tokens", "BOOL", 1, opt=True, scalar=True, feed=True),
            i("return_num_output_tokens", "BOOL", 1, opt=True, scalar=True, feed=True),
            o("num_input_tokens", "INT32", 1, out=True),
            o("num_output_tokens", "INT32", 1, out=True)),
        add("tensorrt_llm_bls",
            i("return_num_input_tokens", "BOOL", 1, opt=True, scalar=True),
            i("return_num_output_tokens", "BOOL", 1, opt=True, scalar=True),
            o("num_input_tokens", "INT32", 1),
            o("num_output_tokens", "INT32", 1)),
        param("hf_model_path", model="preprocessing"),
    ), aliases=("25.10",),
        notes="min_length → min_tokens, random_seed → seed; token counts; backend lives in TensorRT-LLM"),
)


# -- folding rows into profiles -----------------------------------------------------------------

def _split(path: str) -> tuple[str, bool, str]:
    model, side, name = path.split(".", 2)
    if side not in ("in", "out"):
        raise ValueError(f"bad tensor path {path!r}: expected model.in.NAME or model.out.NAME")
    return model, side == "out", name


def _apply(models: dict[str, list[Tensor]], params: dict[tuple[str, str], Parameter],
           batching: set[str], edit: Any, version: str) -> None:
    if isinstance(edit, tuple):
        for e in edit:
            _apply(models, params, batching, e, version)
        return
    if isinstance(edit, Add):
        tensors = models.setdefault(edit.model, [])
        if any(t.name == edit.tensor.name and t.output == edit.tensor.output for t in tensors):
            raise ValueError(f"{version}: {edit.model} already has {edit.tensor.name}")
        tensors.append(edit.tensor)
    elif isinstance(edit, (Drop, Change, Rename)):
        model, output, name = _split(edit.path)
        tensors = models.get(model, [])
        index = next((n for n, t in enumerate(tensors) if t.name == name and t.output == output), None)
        if index is None:
            raise ValueError(f"{version}: {edit.path} does not exist")
        if isinstance(edit, Drop):
            del tensors[index]
        elif isinstance(edit, Change):
            fields = dict(edit.fields)
            for key in ("feed", "out"):  # True: the ensemble tensor has the model tensor's name
                if fields.get(key) is True:
                    fields[key] = name
            tensors[index] = replace(tensors[index], **fields)
        else:
            old = tensors[index]
            feed = edit.new if edit.feed and old.feed == old.name else old.feed
            out = edit.new if edit.feed and old.out == old.name else old.out
            tensors[index] = replace(old, name=edit.new, feed=feed, out=out)
    elif isinstance(edit, SetParam):
        params[(edit.parameter.model, edit.parameter.key)] = edit.parameter
    elif isinstance(edit, DropParam):
        if params.pop((edit.model, edit.key), None) is None:
            raise ValueError(f"{version}: parameter {edit.model}.{edit.key} does not exist")
    elif isinstance(edit, Batching):
        (batching.add if edit.enabled else batching.discard)(edit.model)
    else:
        raise TypeError(f"{version}: unknown edit {edit!r}")


def build(releases: Iterable[Release] = RELEASES) -> dict[str, Profile]:
    """Fold the release rows, oldest first, into one complete profile per version."""
    models: dict[str, list[Tensor]] = {}
    params: dict[tuple[str, str], Parameter] = {}
    batching: set[str] = set()
    profiles: dict[str, Profile] = {}
    for release in releases:
        for edit in release.changes:
            _apply(models, params, batching, edit, release.version)
        profiles[release.version] = Profile(
            version=release.version, triton=release.triton,
            models=tuple((m, Interface(tuple(t for t in ts if not t.output), tuple(t for t in ts if t.output)))
                         for m, ts in models.items()),
            parameters=tuple(params.values()), dynamic_batching=frozenset(batching),
            aliases=release.aliases, notes=release.notes)
    return profiles


PROFILES: Mapping[str, Profile] = build()
NEWEST = RELEASES[-1].version


def known() -> list[str]:
    """Every backend version forge has a profile for, oldest first."""
    return list(PROFILES)


def resolve(version: str | None) -> Profile:
    """The profile for ``--backend-version`` (a version like v0.13.0 / 0.13.0, or an NGC tag like 24.09)."""
    if version is None or version in ("", "latest", "newest"):
        return PROFILES[NEWEST]
    wanted = version.strip()
    candidates = (wanted, f"v{wanted}")
    for profile in PROFILES.values():
        if profile.version in candidates or wanted == profile.triton or wanted in profile.aliases \
                or wanted == profile.container:
            return profile
    listed = ", ".join(f"{p.version} ({p.triton})" for p in PROFILES.values())
    raise UsageError(f"unknown --backend-version {version!r}; known: {listed}")


@dataclass(frozen=True)
class Routes:
    """The ensemble wiring of a profile, by model role (not yet by Triton model name)."""

    feeds: tuple[tuple[str, str, str], ...] = field(default=())  # (ensemble input, model, tensor)
    links: tuple[tuple[str, str, str, str], ...] = field(default=())  # (model, output, model, input)
    results: tuple[tuple[str, str, str], ...] = field(default=())  # (model, output, ensemble output)


def routes(profile: Profile, *, include: Any = lambda model, tensor: True) -> Routes:
    """The ensemble routes of ``profile`` for the tensors ``include(model, tensor)`` keeps."""
    feeds, links, results = [], [], []
    for model in ("preprocessing", "tensorrt_llm", "postprocessing"):
        spec = profile.interface(model)
        for t in spec.inputs:
            if not include(model, t):
                continue
            if t.feed:
                feeds.append((t.feed, model, t.name))
            if t.src:
                src_model, src_tensor = t.src.split(".", 1)
                produced = profile.interface(src_model).output(src_tensor)
                if produced is not None and include(src_model, produced):
                    links.append((src_model, src_tensor, model, t.name))
        for t in spec.outputs:
            if t.out and include(model, t):
                results.append((model, t.name, t.out))
    return Routes(tuple(feeds), tuple(links), tuple(results))
