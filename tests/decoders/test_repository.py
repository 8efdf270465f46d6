"""Emitting decoder repositories (--target tensorrtllm) for each backend profile, with an engine double."""

from __future__ import annotations

import json
import sys

import pytest

import helpers
from forge import tritonconfig as tc
from forge.errors import ForgeError, UsageError
from forge import profiles
from forge.llm import decoder_models as repository
from forge.in_triton import PREPROCESSING

# The ensembles' interfaces as read from tensorrtllm_backend's ensemble/config.pbtxt at each tag:
# (name, dtype, dims, optional).
V0_5_0_INPUTS = [
    ("text_input", "STRING", (-1,), False), ("max_tokens", "UINT32", (-1,), False),
    ("bad_words", "STRING", (-1,), False), ("stop_words", "STRING", (-1,), False),
    ("end_id", "UINT32", (1,), True), ("pad_id", "UINT32", (1,), True), ("top_k", "UINT32", (1,), True),
    ("top_p", "FP32", (1,), True), ("temperature", "FP32", (1,), True), ("length_penalty", "FP32", (1,), True),
    ("repetition_penalty", "FP32", (1,), True), ("min_length", "UINT32", (1,), True),
    ("presence_penalty", "FP32", (1,), True), ("random_seed", "UINT64", (1,), True),
    ("beam_width", "UINT32", (1,), True), ("stream", "BOOL", (1,), True)]
V0_5_0_OUTPUTS = [("text_output", "STRING", (-1, -1))]
V0_13_0_INPUTS = [
    ("text_input", "STRING", (1,), False), ("decoder_text_input", "STRING", (1,), True),
    ("max_tokens", "INT32", (1,), False), ("bad_words", "STRING", (-1,), True), ("stop_words", "STRING", (-1,), True),
    ("end_id", "INT32", (1,), True), ("pad_id", "INT32", (1,), True), ("top_k", "INT32", (1,), True),
    ("top_p", "FP32", (1,), True), ("temperature", "FP32", (1,), True), ("length_penalty", "FP32", (1,), True),
    ("repetition_penalty", "FP32", (1,), True), ("min_length", "INT32", (1,), True),
    ("presence_penalty", "FP32", (1,), True), ("frequency_penalty", "FP32", (1,), True),
    ("random_seed", "UINT64", (1,), True), ("return_log_probs", "BOOL", (1,), True),
    ("return_context_logits", "BOOL", (1,), True), ("return_generation_logits", "BOOL", (1,), True),
    ("beam_width", "INT32", (1,), True), ("stream", "BOOL", (1,), True),
    ("prompt_embedding_table", "FP16", (-1, -1), True), ("prompt_table_extra_id", "UINT64", (1,), True),
    ("prompt_vocab_size", "INT32", (1,), True), ("embedding_bias_words", "STRING", (-1,), True),
    ("embedding_bias_weights", "FP32", (-1,), True)]
V0_13_0_OUTPUTS = [("text_output", "STRING", (-1,)), ("cum_log_probs", "FP32", (-1,)),
                   ("output_log_probs", "FP32", (-1, -1)), ("context_logits", "FP32", (-1, -1)),
                   ("generation_logits", "FP32", (-1, -1, -1)), ("batch_index", "INT32", (1,))]
# v1.0.0 (TensorRT-LLM triton_backend): logits dtype is the engine's (FP32 here).
V1_0_0_INPUTS = [
    ("text_input", "STRING", (1,), False), ("decoder_text_input", "STRING", (1,), True),
    ("max_tokens", "INT32", (1,), False), ("num_return_sequences", "INT32", (1,), True),
    ("bad_words", "STRING", (-1,), True), ("stop_words", "STRING", (-1,), True),
    ("exclude_input_in_output", "BOOL", (1,), True), ("end_id", "INT32", (1,), True),
    ("pad_id", "INT32", (1,), True), ("top_k", "INT32", (1,), True), ("top_p", "FP32", (1,), True),
    ("temperature", "FP32", (1,), True), ("length_penalty", "FP32", (1,), True),
    ("repetition_penalty", "FP32", (1,), True), ("min_tokens", "INT32", (1,), True),
    ("presence_penalty", "FP32", (1,), True), ("frequency_penalty", "FP32", (1,), True),
    ("seed", "UINT64", (1,), True), ("return_log_probs", "BOOL", (1,), True),
    ("return_context_logits", "BOOL", (1,), True), ("return_generation_logits", "BOOL", (1,), True),
    ("return_perf_metrics", "BOOL", (1,), True), ("return_num_input_tokens", "BOOL", (1,), True),
    ("return_num_output_tokens", "BOOL", (1,), True), ("beam_width", "INT32", (1,), True),
    ("stream", "BOOL", (1,), True), ("prompt_embedding_table", "FP16", (-1, -1), True),
    ("prompt_table_extra_id", "UINT64", (1,), True), ("prompt_vocab_size", "INT32", (1,), True),
    ("embedding_bias_words", "STRING", (-1,), True), ("embedding_bias_weights", "FP32", (-1,), True),
    ("lora_task_id", "UINT64", (1,), True), ("lora_weights", "FP16", (-1, -1), True),
    ("lora_config", "INT32", (-1, 3), True), ("guided_decoding_guide_type", "STRING", (1,), True),
    ("guided_decoding_guide", "STRING", (1,), True)]
V1_0_0_OUTPUTS = [
    ("text_output", "STRING", (-1,)), ("cum_log_probs", "FP32", (-1,)), ("output_log_probs", "FP32", (-1, -1)),
    ("context_logits", "FP32", (-1, -1)), ("generation_logits", "FP32", (-1, -1, -1)),
    ("batch_index", "INT32", (1,)), ("sequence_index", "INT32", (1,)),
    ("kv_cache_alloc_new_blocks", "INT32", (1,)), ("kv_cache_reused_blocks", "INT32", (1,)),
    ("kv_cache_alloc_total_blocks", "INT32", (1,)), ("arrival_time_ns", "INT64", (1,)),
    ("first_scheduled_time_ns", "INT64", (1,)), ("first_token_time_ns", "INT64", (1,)),
    ("last_token_time_ns", "INT64", (1,)), ("acceptance_rate", "FP32", (1,)),
    ("total_accepted_draft_tokens", "INT32", (1,)), ("total_draft_tokens", "INT32", (1,)),
    ("num_input_tokens", "INT32", (1,)), ("num_output_tokens", "INT32", (1,))]
GOLDEN = {"v0.5.0": (V0_5_0_INPUTS, V0_5_0_OUTPUTS), "v0.13.0": (V0_13_0_INPUTS, V0_13_0_OUTPUTS),
          "v1.0.0": (V1_0_0_INPUTS, V1_0_0_OUTPUTS), None: (V1_0_0_INPUTS, V1_0_0_OUTPUTS)}


def interface(config):
    inputs = sorted((t.name, tc.dtype_name(t.data_type), tuple(t.dims), t.optional) for t in config.input)
    outputs = sorted((t.name, tc.dtype_name(t.data_type), tuple(t.dims)) for t in config.output)
    return inputs, outputs


@pytest.mark.parametrize("version", ["v0.5.0", "v0.13.0", "v1.0.0", None])
def test_repository_validates_and_ensemble_matches_the_backend(version, hf_dir, tmp_path):
    """None: the newest engine release (helpers.ENGINE), whose tensors are v1.0.0's."""
    out = tmp_path / "repo"
    models, edges, ctx, _ = helpers.emit(hf_dir, out, tmp_path, version=version)
    assert helpers.write(models, edges, out) == []
    assert sorted(p.name for p in out.iterdir()) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    configs = {p.name: tc.read(p) for p in out.iterdir()}  # every config parses with the protobuf schema
    golden_inputs, golden_outputs = GOLDEN[version]
    assert interface(configs["ensemble"]) == (sorted(golden_inputs), sorted(golden_outputs))
    llm = configs["tensorrt_llm"]
    assert llm.backend == "tensorrtllm" and llm.max_batch_size == 8
    assert tc.parameter(llm, "gpt_model_path") == str((out / "tensorrt_llm" / "1").resolve())
    assert sorted(p.name for p in (out / "tensorrt_llm" / "1").iterdir()) == ["config.json", "rank0.engine"]
    profile = profiles.resolve(version or helpers.ENGINE)
    expected_llm = sorted((t.name, t.output) for t in profile.interface("tensorrt_llm").inputs
                          + profile.interface("tensorrt_llm").outputs)
    assert sorted([(t.name, False) for t in llm.input] + [(t.name, True) for t in llm.output]) == expected_llm
    assert f"tensorrtllm_backend {profile.version}" in " ".join(ctx.logged)


def test_tokenizer_is_copied_into_the_python_models(hf_dir, tmp_path):
    out = tmp_path / "repo"
    models, edges, _, _ = helpers.emit(hf_dir, out, tmp_path)
    helpers.write(models, edges, out)
    for model in ("preprocessing", "postprocessing"):
        version_dir = out / model / "1"
        assert (version_dir / "tokenizer" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
        assert (version_dir / "tokenizer" / "generation_config.json").is_file()
        assert (version_dir / "forge_text.py").is_file()
        assert tc.parameter(tc.read(out / model), "tokenizer_dir") == "tokenizer"
    # The repository owns its files: no hard link back to forge's sources or the user's checkpoint.
    assert (out / "preprocessing" / "1" / "model.py").stat().st_ino != PREPROCESSING.stat().st_ino
    assert (out / "preprocessing" / "1" / "tokenizer" / "tokenizer.json").stat().st_ino != \
        (hf_dir / "tokenizer.json").stat().st_ino


def test_tensorrt_llm_parameters_default_and_override(hf_dir, tmp_path):
    out = tmp_path / "repo"
    models, _, _, _ = helpers.emit(hf_dir, out, tmp_path, version="v0.13.0")
    llm = models["tensorrt_llm"].config
    assert tc.parameter(llm, "gpt_model_type") == "inflight_fused_batching"
    assert tc.parameter(llm, "batch_scheduler_policy") == "guaranteed_no_evict"
    assert tc.parameter(llm, "kv_cache_free_gpu_mem_fraction") == "0.9"
    assert tc.parameter(llm, "enable_kv_cache_reuse") == "false"
    assert tc.parameter(llm, "exclude_input_in_output") == "false"
    assert tc.parameter(llm, "max_beam_width") == "1"
    assert tc.parameter(llm, "max_tokens_in_paged_kv_cache") is None  # documented default: unset
    assert tc.parameter(llm, "executor_worker_path").endswith("trtllmExecutorWorker")
    assert not llm.model_transaction_policy.decoupled
    assert list(llm.dynamic_batching.preferred_batch_size) == [8]

    options = {"batching_strategy": "V1", "batch_scheduler_policy": "max_utilization",
               "kv_cache_free_gpu_mem_fraction": 0.5, "max_tokens_in_paged_kv_cache": 4096,
               "enable_kv_cache_reuse": True, "kv_cache_host_memory_bytes": 1 << 30,
               "enable_chunked_context": True, "exclude_input_in_output": True, "decoding_mode": "top_k",
               "decoupled": True, "max_queue_delay_microseconds": 100, "max_queue_size": 64,
               "engine_dir": "/models/tensorrt_llm/1", "instances": 3}
    models, _, ctx, _ = helpers.emit(hf_dir, tmp_path / "repo2", tmp_path, version="v0.13.0", options=options)
    llm = models["tensorrt_llm"].config
    assert tc.parameter(llm, "gpt_model_type") == "V1"
    assert any("V1 is deprecated" in line for line in ctx.logged)
    assert tc.parameter(llm, "batch_scheduler_policy") == "max_utilization"
    assert tc.parameter(llm, "kv_cache_free_gpu_mem_fraction") == "0.5"
    assert tc.parameter(llm, "max_tokens_in_paged_kv_cache") == "4096"
    assert tc.parameter(llm, "enable_kv_cache_reuse") == "true"
    assert tc.parameter(llm, "kv_cache_host_memory_bytes") == str(1 << 30)
    assert tc.parameter(llm, "enable_chunked_context") == "true"
    assert tc.parameter(llm, "exclude_input_in_output") == "true"
    assert tc.parameter(llm, "decoding_mode") == "top_k"
    assert tc.parameter(llm, "gpt_model_path") == "/models/tensorrt_llm/1"
    assert llm.model_transaction_policy.decoupled
    assert llm.dynamic_batching.max_queue_delay_microseconds == 100
    assert llm.dynamic_batching.default_queue_policy.max_queue_size == 64
    assert llm.instance_group[0].count == 1  # the C++ backend runs one instance; -o instances is for python models
    assert models["preprocessing"].config.instance_group[0].count == 3
    assert models["postprocessing"].config.instance_group[0].count == 3


def test_version_specific_parameters(hf_dir, tmp_path):
    old, _, _, _ = helpers.emit(hf_dir, tmp_path / "old", tmp_path, version="v0.5.0")
    new, _, _, _ = helpers.emit(hf_dir, tmp_path / "new", tmp_path)
    assert tc.parameter(old["tensorrt_llm"].config, "enable_trt_overlap") == "true"
    assert tc.parameter(old["tensorrt_llm"].config, "kv_cache_free_gpu_mem_fraction") == "0.85"
    assert tc.parameter(old["preprocessing"].config, "tokenizer_type") == "auto"
    assert not old["tensorrt_llm"].config.HasField("dynamic_batching")
    assert tc.parameter(new["tensorrt_llm"].config, "enable_trt_overlap") is None
    assert tc.parameter(new["tensorrt_llm"].config, "enable_kv_cache_reuse") == "true"
    assert tc.parameter(new["preprocessing"].config, "tokenizer_type") is None
    llm_inputs = {t.name: t for t in new["tensorrt_llm"].config.input}
    assert tc.dtype_name(llm_inputs["prompt_embedding_table"].data_type) == "FP16"  # --dtype float16
    old_inputs = {t.name: t for t in old["tensorrt_llm"].config.input}
    assert tc.dtype_name(old_inputs["request_output_len"].data_type) == "UINT32"


def test_logits_dtype_follows_the_engine_or_the_option(hf_dir, tmp_path):
    models, _, _, _ = helpers.emit(hf_dir, tmp_path / "a", tmp_path, logits_dtype="float16")
    outputs = {t.name: t for t in models["tensorrt_llm"].config.output}
    assert tc.dtype_name(outputs["generation_logits"].data_type) == "FP16"
    models, _, _, _ = helpers.emit(hf_dir, tmp_path / "b", tmp_path, options={"logits_datatype": "TYPE_BF16"})
    outputs = {t.name: t for t in models["tensorrt_llm"].config.output}
    assert tc.dtype_name(outputs["context_logits"].data_type) == "BF16"


def test_tokenizer_defaults_reach_preprocessing(tokenizer_dirs, tmp_path):
    source = tokenizer_dirs["sentencepiece"]  # generation_config lists a second end-of-turn id (5)
    models, _, _, _ = helpers.emit(source, tmp_path / "repo", tmp_path)
    pre = models["preprocessing"].config
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    assert tc.parameter(pre, "end_id") == str(tokenizer.eos_token_id)
    assert tc.parameter(pre, "stop_token_ids") == "5"
    assert tc.parameter(pre, "add_special_tokens") == "true"
    assert tc.parameter(pre, "max_input_len") == "512"  # 1024 positions: the prompt keeps half, as the engine
    models, _, _, _ = helpers.emit(source, tmp_path / "repo2", tmp_path, version="v0.8.0",
                                   options={"end_id": 2, "stop_token_ids": ""})
    pre = models["preprocessing"].config
    assert tc.parameter(pre, "end_id") == "2" and tc.parameter(pre, "stop_token_ids") == ""
    assert tc.parameter(pre, "add_special_tokens") == "false"  # the v0.8.0 template's value


def test_bls_model(hf_dir, tmp_path):
    out = tmp_path / "repo"
    models, edges, _, _ = helpers.emit(hf_dir, out, tmp_path, options={"bls": True, "decoupled": True},
                                       prefix="chat_")
    assert helpers.write(models, edges, out) == []
    assert sorted(models) == ["chat_postprocessing", "chat_preprocessing", "chat_tensorrt_llm", "chat_tensorrt_llm_bls"]
    bls = models["chat_tensorrt_llm_bls"].config
    assert bls.backend == "python" and bls.model_transaction_policy.decoupled
    assert tc.parameter(bls, "tensorrt_llm_model_name") == "chat_tensorrt_llm"
    assert tc.parameter(bls, "preprocessing_model_name") == "chat_preprocessing"
    routes = json.loads(tc.parameter(bls, "forge_routes"))
    assert ["text_input", "QUERY"] in routes["preprocessing"]
    assert ["top_k", "runtime_top_k"] in routes["tensorrt_llm"]
    assert ["INPUT_ID", "input_ids"] in routes["links"]
    assert ["num_output_tokens", "num_output_tokens"] in routes["outputs"]
    assert routes["stream_input"] == "streaming"
    names = {t.name for t in bls.input}
    assert {"text_input", "max_tokens", "stream", "min_tokens", "seed", "num_draft_tokens"} <= names
    assert (out / "chat_ensemble").is_dir()


def test_bls_of_an_old_version_routes_log_probs_like_its_ensemble(hf_dir, tmp_path):
    models, _, _, _ = helpers.emit(hf_dir, tmp_path / "repo", tmp_path, version="v0.8.0", options={"bls": True})
    routes = json.loads(tc.parameter(models["tensorrt_llm_bls"].config, "forge_routes"))
    # v0.8.0 passes log probs through postprocessing; the BLS takes them from tensorrt_llm directly.
    assert ["cum_log_probs", "cum_log_probs"] in routes["outputs"]
    assert ["end_id", "END_ID"] in routes["preprocessing"]


def test_tensor_parallel_engine(hf_dir, tmp_path):
    out = tmp_path / "repo"
    models, edges, ctx, _ = helpers.emit(hf_dir, out, tmp_path, tp=2)
    assert helpers.write(models, edges, out) == []
    assert sorted(p.name for p in (out / "tensorrt_llm" / "1").iterdir()) == ["config.json", "rank0.engine", "rank1.engine"]
    assert any("mpirun -n 2" in line for line in ctx.logged)
    (out / "tensorrt_llm" / "1" / "rank1.engine").unlink()
    from forge.checks import validate_repository

    assert any("1 rank engine files but tp×pp = 2" in p for p in validate_repository(out))


@pytest.mark.parametrize("options, message", [
    ({"batching_strategy": "static"}, "choose one of inflight_fused_batching"),
    ({"batch_scheduler_policy": "fifo"}, "guaranteed_no_evict"),
    ({"kv_cache_free_gpu_mem_fraction": 1.5}, "(0, 1]"),
    ({"kv_cache_free_gpu_mem_fraction": "lots"}, "takes a number"),
    ({"max_tokens_in_paged_kv_cache": "many"}, "takes an integer"),
    ({"enable_chunked_context": "maybe"}, "true or false"),
    ({"enable_trt_overlap": True}, "not a parameter of tensorrtllm_backend v1.0.0 (it exists in v0.5.0–v1.2.1)"),
    ({"FORCE_CPU_ONLY_INPUT_TENSORS": "yes"}, "set by forge"),
    ({"tensorrt_llm_model_name": "other"}, "set by forge"),
    ({"instances": 0}, "at least 1"),
    ({"max_queue_size": -1}, "must be at least 0"),
    ({"logits_datatype": "TYPE_INT8"}, "TYPE_FP32, TYPE_FP16 or TYPE_BF16"),
    ({"max_beam_width": 4}, "exceeds the engine's beam width"),
])
def test_bad_options_are_usage_errors(options, message, hf_dir, tmp_path):
    """Bad input: every -o value the Triton side cannot use fails before anything is written."""
    with pytest.raises(UsageError) as err:
        helpers.emit(hf_dir, tmp_path / "repo", tmp_path, options=options,
                     version="v1.0.0" if "enable_trt_overlap" in options else None)
    assert message in str(err.value) and "\n" not in err.value.one_line()


def test_bls_needs_a_version_that_has_it(hf_dir, tmp_path):
    """Bad input: -o bls=true with --backend-version v0.5.0 (no tensorrt_llm_bls before v0.7.1)."""
    with pytest.raises(UsageError, match="v0.7.1 or newer"):
        helpers.emit(hf_dir, tmp_path / "repo", tmp_path, version="v0.5.0", options={"bls": True})


def test_unknown_backend_version(hf_dir, tmp_path):
    """Bad input: --backend-version v2.0 fails with the list of known versions."""
    with pytest.raises(UsageError, match="unknown --backend-version 'v2.0'; known: v0.5.0"):
        helpers.emit(hf_dir, tmp_path / "repo", tmp_path, version="v2.0")


def test_checkpoint_without_tokenizer(tmp_path):
    """Bad input: a model directory with no tokenizer files."""
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="has no tokenizer"):
        helpers.emit(source, tmp_path / "repo", tmp_path)


def test_broken_tokenizer(hf_dir, tmp_path):
    """Bad input: a tokenizer.json that does not parse is reported at build time, not at serve time."""
    source = tmp_path / "model"
    source.mkdir()
    for path in hf_dir.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    (source / "tokenizer.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot load the tokenizer"):
        helpers.emit(source, tmp_path / "repo", tmp_path)


def test_engine_dir_without_engines(hf_dir, tmp_path):
    """Bad input: a compile artifact without rank files."""
    ctx = helpers.context(hf_dir, tmp_path / "repo")
    artifact = helpers.engine_artifact(tmp_path)
    (artifact.path / "rank0.engine").unlink()
    with pytest.raises(ForgeError, match="lacks config.json or rank"):
        repository.emit(None, helpers.component(hf_dir), artifact, ctx)


def test_python_target_without_the_python_target_module(hf_dir, tmp_path, monkeypatch):
    """--target python when forge.llm.pytarget cannot be imported gives one clear error."""
    import forge.llm

    monkeypatch.setitem(sys.modules, "forge.llm.pytarget", None)
    monkeypatch.delattr(forge.llm, "pytarget", raising=False)
    ctx = helpers.context(hf_dir, tmp_path / "repo", target="python")
    artifact = helpers.engine_artifact(tmp_path)
    artifact.kind = "trtllm-checkpoint"
    with pytest.raises(ForgeError, match="--target python is not available"):
        repository.emit(None, helpers.component(hf_dir), artifact, ctx)
