"""TensorRT-LLM's LLM-API releases: one python-backend ``tensorrt_llm`` model, configured by ``1/model.yaml``.

TensorRT-LLM deprecated ``trtllm-build`` and its TensorRT engine backend in February 2026 and deleted the
Triton C++ backend (``inflight_batcher_llm``) and every engine template on 2026-07-03; what remains is
``triton_backend/all_models/llmapi``: a ``tensorrt_llm`` model whose ``config.pbtxt`` takes ``text_input``
(+ ``image_url``, ``streaming``, ``sampling_param_*``, ``return_*``, ``stop``, ``lora_*``) and returns
``text_output`` (+ ``finish_reason``, ``stop_reason``, ``cumulative_logprob``, KV-cache and timing
outputs), and whose ``1/model.yaml`` holds the LLM API's arguments plus a ``triton_config`` section.

The tensors come from ``triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt`` of NVIDIA/TensorRT-LLM;
the ``model.yaml`` keys from ``tensorrt_llm/llmapi/llm_args.py`` (``TorchLlmArgs``) of the same release.
Each key forge writes is a :class:`~.vocabulary.Parameter` whose ``model`` is ``model.yaml`` and whose
``key`` is its dotted path (``kv_cache_config.free_gpu_memory_fraction``); the ``-o`` names stay those of
the engine releases where the meaning is the same, so one option works on both layouts.
"""

from __future__ import annotations

from .vocabulary import LLMAPI, YAML, Release, add, i, o, param

LLM = "tensorrt_llm"
# capacity_scheduler_policy of the LLM API's SchedulerConfig
CAPACITY = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH")


def key(path: str, default=None, *, option: str = "", kind: str = "str", **kw) -> object:
    """A ``model.yaml`` key (dotted path), set by ``-o option`` (default: the key's last part)."""
    return param(path, default, model=YAML, option=option or path.rsplit(".", 1)[-1], kind=kind, **kw)


def fixed(path: str) -> object:
    """A ``model.yaml`` key forge always writes from the build (flags, the checkpoint), never from ``-o``."""
    return param(path, model=YAML, fixed=True)


#: The interface of the first LLM-API row; later rows list what changed, as the engine rows do.
FIRST = (
    add(LLM,
        i("text_input", "STRING", -1),
        i("image_url", "STRING", -1, opt=True, mm=True),
        i("streaming", "BOOL", 1, opt=True),
        i("sampling_param_best_of", "INT32", 1, opt=True),
        i("sampling_param_temperature", "FP32", 1, opt=True),
        i("sampling_param_top_k", "INT32", 1, opt=True),
        i("sampling_param_top_p", "FP32", 1, opt=True),
        i("sampling_param_frequency_penalty", "FP32", 1, opt=True),
        i("sampling_param_presence_penalty", "FP32", 1, opt=True),
        i("sampling_param_max_tokens", "INT32", 1, opt=True),
        i("sampling_param_stop", "STRING", -1, opt=True),
        i("sampling_param_seed", "UINT64", 1, opt=True),
        i("sampling_param_exclude_input_from_output", "BOOL", 1, opt=True),
        i("sampling_param_return_perf_metrics", "BOOL", 1, opt=True),
        i("return_finish_reason", "BOOL", 1, opt=True),
        i("return_stop_reason", "BOOL", 1, opt=True),
        i("return_cumulative_logprob", "BOOL", 1, opt=True),
        i("stop", "BOOL", 1, opt=True),
        i("lora_id", "UINT64", 1, opt=True),
        i("lora_name", "STRING", 1, opt=True),
        i("lora_path", "STRING", 1, opt=True),
        i("lora_ckpt_source", "STRING", 1, opt=True),
        o("text_output", "STRING", -1),
        o("finish_reason", "STRING", -1),
        o("stop_reason", "STRING", -1),
        o("cumulative_logprob", "FP32", -1),
        o("kv_cache_reused_block", "INT32", -1),
        o("kv_cache_missed_block", "INT32", -1),
        o("kv_cache_alloc_new_blocks", "INT32", -1),
        o("kv_cache_alloc_total_blocks", "INT32", -1),
        o("kv_cache_hit_rate", "FP32", -1),
        o("arrival_time_ns", "INT64", 1),
        o("first_scheduled_time_ns", "INT64", 1),
        o("first_token_time_ns", "INT64", 1),
        o("last_token_time_ns", "INT64", 1),
        o("acceptance_rate", "FP32", 1),
        o("total_accepted_draft_tokens", "INT32", 1),
        o("total_draft_tokens", "INT32", 1)),
    # what the build decides (the checkpoint in the repository, --tp/--pp/--dtype, the limits; ``backend`` is
    # deprecated and pytorch the only value, so it is left out)
    fixed("model"),
    fixed("tensor_parallel_size"),
    fixed("pipeline_parallel_size"),
    fixed("dtype"),
    fixed("trust_remote_code"),
    fixed("max_batch_size"),
    fixed("max_seq_len"),
    fixed("max_input_len"),
    fixed("max_num_tokens"),
    fixed("max_beam_width"),
    fixed("triton_config.max_batch_size"),
    fixed("triton_config.decoupled"),
    fixed("triton_config.multimodal"),
    fixed("lora_config.lora_dir"),
    fixed("lora_config.lora_target_modules"),
    # what -o sets (the engine releases' names where the meaning is the same)
    key("kv_cache_config.free_gpu_memory_fraction", option="kv_cache_free_gpu_mem_fraction", kind="float",
        help="fraction of free GPU memory the KV cache may take (model.yaml kv_cache_config)"),
    key("kv_cache_config.enable_block_reuse", option="enable_kv_cache_reuse", kind="bool",
        help="reuse KV-cache blocks of shared prompt prefixes (model.yaml kv_cache_config)"),
    key("kv_cache_config.max_tokens", option="max_tokens_in_paged_kv_cache", kind="int",
        help="KV-cache size in tokens (model.yaml kv_cache_config; default: by memory fraction)"),
    key("enable_chunked_prefill", option="enable_chunked_context", kind="bool",
        help="split long prompts into chunks that share steps with decoding (model.yaml)"),
    key("scheduler_config.capacity_scheduler_policy", option="batch_scheduler_policy", choices=CAPACITY,
        help="how the scheduler admits requests (model.yaml scheduler_config)"),
    key("disable_overlap_scheduler", kind="bool",
        help="run steps one at a time instead of overlapping the host's work with the GPU's (model.yaml)"),
    key("lora_config.max_lora_rank", kind="int", help="largest LoRA rank served (default: the shipped adapters')"),
    key("lora_config.max_loras", kind="int", help="LoRA adapters held on the GPU at once"),
    key("lora_config.max_cpu_loras", kind="int", help="LoRA adapters held in host memory at once"),
    key("stream_interval", kind="int", help="tokens per streamed response after the first, which goes at once "
        "(model.yaml; default 1: every token; more: fewer responses under load)"),
    key("triton_config.cancellation_check_period_ms", kind="int",
        help="how often a request's cancellation is checked (model.yaml triton_config)"),
)

#: From v1.3.0rc21 (2026-07-15, the first tag after the engine templates were deleted) TensorRT-LLM ships no
#: engine backend; the newest tag is v1.3.0rc29 and no NGC tritonserver release ships a 1.3 build yet (the
#: newest trtllm container, 26.07, carries v1.2.1), so these rows name no container. ``image_url`` and the
#: ``lora_*`` inputs are in the template from the 1.3 pre-releases on.
LLMAPI_RELEASES: tuple[Release, ...] = (
    Release("v1.3.0rc29", "", (FIRST,), layout=LLMAPI,
            notes="the LLM API on PyTorch only: one python-backend tensorrt_llm model, model.yaml, no engine"),
)
