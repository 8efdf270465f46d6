"""The LLM-API layout (TensorRT-LLM releases without engines): what ``forge build`` writes, checked against the
LLM API's own argument model and request classes as read from TensorRT-LLM's source (``data/llmapi_args.json``,
provenance inside), and everything ``model.py`` does before it calls the LLM API.

Bad inputs tried here: an ``-o`` key of the engine releases that the LLM API does not take, ``--quant`` modes the
release cannot load (w8a16, w4a16, int8_kv), two weight formats at once, ``--tp`` that does not divide the heads,
``--backend-version`` naming no release, ``--instances 2``, ``-o bls=true``, an ``image_url`` with ``file://`` or a
local path, a LoRA request missing ``lora_path``, a ``lora_path`` leaving the model's ``lora/`` folder, a LoRA
checkpoint source the API does not know, ``streaming`` on a model that is not decoupled, values out of range,
and serving the repository on a machine without TensorRT-LLM. Token-level requests (token-id prompts, log-probs)
are tested in ``test_llmapi_token_level.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from forge import profiles
from forge import tritonconfig as tc
from forge.cli import main
from forge.in_triton import forge_llmapi
from forge.checks import validate_repository

ARGS = json.loads((Path(__file__).parent / "data" / "llmapi_args.json").read_text())
NEWEST = profiles.resolve(None)


def _fields(entries) -> dict[str, dict]:
    return {e["name"]: e for e in entries}


LLM_FIELDS = _fields(ARGS["llm_args"]["base_llm_args_fields"] + ARGS["llm_args"]["torch_llm_args_fields"])
NESTED = {"kv_cache_config": "KvCacheConfig", "scheduler_config": "SchedulerConfig", "lora_config": "LoraConfig"}
SAMPLING_FIELDS = _fields(ARGS["sampling_params"]["fields"])
LORA_FIELDS = _fields(ARGS["lora_request"]["fields"])


def build(model: Path, out: Path, *extra: str) -> int:
    return main(["build", "--family", "gpt", "--model", str(model), "--out", str(out), *extra])


def model_yaml(out: Path) -> dict:
    return yaml.safe_load((out / "tensorrt_llm" / "1" / "model.yaml").read_text())


def _type_ok(value, declared: str) -> bool:
    """A model.yaml value against the type written in llm_args.py (the parts forge writes)."""
    if declared == "PositiveInt":  # pydantic's
        return isinstance(value, int) and not isinstance(value, bool) and value > 0
    kinds = {"int": int, "float": (int, float), "bool": bool, "str": str, "Path": str, "List[str]": list}
    for name, kind in kinds.items():
        if name in declared.replace("Optional[", "").replace("Union[", "") and isinstance(value, kind):
            return not (kind is int and isinstance(value, bool))
    return any(word in declared for word in ("Literal", "Policy", "Config")) and isinstance(value, str)


def check_against_llm_args(doc: dict) -> None:
    """Every key the LLM API's argument model takes (extra keys are forbidden there), with a value of its type."""
    assert ARGS["llm_args"]["model_config"]["extra_forbid"]
    for key, value in doc.items():
        if key == "triton_config":  # model.py strips it before LLM(**args)
            continue
        assert key in LLM_FIELDS, f"model.yaml key {key!r} is not an LLM API argument"
        assert not LLM_FIELDS[key].get("deprecated"), f"model.yaml key {key!r} is deprecated"
        if key in NESTED:
            nested = _fields(ARGS["nested_classes"][NESTED[key]]["fields"])
            for sub, sub_value in value.items():
                assert sub in nested, f"model.yaml key {key}.{sub} is not a field of {NESTED[key]}"
                assert _type_ok(sub_value, nested[sub]["type"]), (key, sub, sub_value, nested[sub]["type"])
        else:
            assert _type_ok(value, LLM_FIELDS[key]["type"]), (key, value, LLM_FIELDS[key]["type"])


def test_the_default_build_writes_the_newest_release_llmapi_repository(tiny_gpt2, tmp_path):
    """``forge build`` with no flag but the model: no engine, no trtllm-build, a complete repository."""
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out) == 0
    assert validate_repository(out) == [] and main(["validate", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["tensorrt_llm"]
    files = sorted(p.relative_to(out / "tensorrt_llm" / "1").as_posix()
                   for p in (out / "tensorrt_llm" / "1").rglob("*") if p.is_file())
    assert {"model.py", "model.yaml", "forge_llmapi.py", "forge_glue.py", "hf/config.json", "hf/model.safetensors",
            "hf/tokenizer.json"} <= set(files)
    config = tc.read(out / "tensorrt_llm")
    assert config.backend == "python" and config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled  # streams by default; -o decoupled=false writes one response
    spec = NEWEST.interface("tensorrt_llm")
    # TensorRT-LLM's interface tensor by tensor, then forge's optional additions (as the python target declares)
    assert [(t.name, tc.dtype_name(t.data_type), list(t.dims), t.optional) for t in config.input] == \
        [(t.name, t.dtype, list(t.dims), t.optional) for t in spec.inputs] + \
        [(name, kind, [dim], True) for name, kind, dim in forge_llmapi.EXTENSION_INPUTS]
    assert [(t.name, tc.dtype_name(t.data_type), list(t.dims)) for t in config.output] == \
        [(t.name, t.dtype, list(t.dims)) for t in spec.outputs] + \
        [(name, kind, [dim]) for name, kind, dim in forge_llmapi.EXTENSION_OUTPUTS]
    doc = model_yaml(out)
    assert doc == {"model": "hf", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                   "triton_config": {"max_batch_size": 0, "decoupled": True}}
    check_against_llm_args(doc)
    manifest = json.loads((out / "forge-manifest.json").read_text())
    stages = [stage for c in manifest["components"] for stage in c["stages"]]
    assert stages and not any(stage.get("commands") for stage in stages)  # nothing ran: no conversion, no engine


def test_flags_and_options_reach_model_yaml_as_the_llm_api_names_them(tiny_gpt2, tmp_path):
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out, "--dtype", "bfloat16", "--max-batch-size", "64", "--max-seq-len", "512",
                 "--max-num-tokens", "4096", "--decoupled", "-o", "kv_cache_free_gpu_mem_fraction=0.5",
                 "-o", "enable_kv_cache_reuse=false", "-o", "batch_scheduler_policy=MAX_UTILIZATION",
                 "-o", "enable_chunked_context=true", "-o", "cancellation_check_period_ms=20",
                 "-o", "max_tokens_in_paged_kv_cache=8192", "-o", "stream_interval=4") == 0
    doc = model_yaml(out)
    assert doc["dtype"] == "bfloat16" and doc["max_batch_size"] == 64 and doc["max_seq_len"] == 512
    assert doc["max_num_tokens"] == 4096 and doc["enable_chunked_prefill"] is True and doc["stream_interval"] == 4
    assert doc["kv_cache_config"] == {"free_gpu_memory_fraction": 0.5, "enable_block_reuse": False,
                                      "max_tokens": 8192}
    assert doc["scheduler_config"] == {"capacity_scheduler_policy": "MAX_UTILIZATION"}
    assert doc["triton_config"] == {"cancellation_check_period_ms": 20, "max_batch_size": 0, "decoupled": True}
    assert tc.read(out / "tensorrt_llm").model_transaction_policy.decoupled
    check_against_llm_args(doc)


def test_every_declared_model_yaml_key_is_an_llm_api_argument():
    """The profile's list of keys (what forge may ever write), not only one build's."""
    for p in NEWEST.yaml_keys():
        top, _, sub = p.key.partition(".")
        if top == "triton_config":
            continue
        assert top in LLM_FIELDS, p.key
        if sub:
            assert sub in _fields(ARGS["nested_classes"][NESTED[top]]["fields"]), p.key
    assert "backend" not in {p.key for p in NEWEST.yaml_keys()}  # deprecated: left out


def test_the_python_target_serves_the_same_interface(tiny_gpt2, tmp_path):
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out, "--target", "python", "--dtype", "float32") == 0
    assert validate_repository(out) == []
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["tensorrt_llm"]
    python = tc.read(out / "tensorrt_llm")
    spec = NEWEST.interface("tensorrt_llm")
    # TensorRT-LLM's interface, then forge's optional additions (token-id prompts, log-probs, token counts)
    extra_in = [name for name, _kind, _dim in forge_llmapi.EXTENSION_INPUTS]
    extra_out = [name for name, _kind, _dim in forge_llmapi.EXTENSION_OUTPUTS]
    assert [t.name for t in python.input] == [t.name for t in spec.inputs] + extra_in
    assert [t.name for t in python.output] == [t.name for t in spec.outputs] + extra_out
    assert all(t.optional for t in python.input if t.name in extra_in)
    assert python.max_batch_size == 0 and tc.parameter(python, "forge_layout") == "llmapi"
    assert (out / "tensorrt_llm" / "1" / "hf" / "tokenizer.json").is_file()


@pytest.mark.parametrize("extra, message", [
    (["-o", "batching_strategy=inflight_fused_batching"],
     "-o batching_strategy is not a parameter of TensorRT-LLM v1.3.0rc29"),
    (["--quant", "w8a16"], "--quant w8a16: TensorRT-LLM v1.3.0rc29's PyTorch backend cannot load it"),
    (["--quant", "w4a16"], "cannot load it"),
    (["--quant", "int8_kv"], "its KV cache takes fp8 or nvfp4"),
    (["--quant", "fp8,int4_awq"], "choose one weight format"),
    (["--tp", "3"], "2 attention heads cannot be split over --tp 3"),
    (["--backend-version", "v9.9.9"], "unknown --backend-version 'v9.9.9'"),
    (["--instances", "2"], "--instances 2 is not supported"),
    (["-o", "bls=true"], "has no tensorrt_llm_bls model"),
    (["-o", "batch_scheduler_policy=fifo"], "choose one of"),
    (["-o", "stream_interval=0"], "-o stream_interval must be at least 1"),
    (["-o", "stream_interval=4", "-o", "decoupled=false"], "-o stream_interval=4 has nothing to space out"),
    (["-o", "stream_interval=4", "-o", "decoupled=false", "--target", "python"], "does not stream"),
    (["-o", "stream_interval=3", "--target", "python", "--backend-version", "1.2.1"],
     "-o stream_interval is not a parameter of tensorrtllm_backend v1.2.1"),
])
def test_bad_inputs_fail_in_one_line_before_anything_is_written(extra, message, tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out, *extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], errors
    assert not out.exists()


def test_older_releases_keep_the_engine_layout(tiny_gpt2, tmp_path):
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out, "--target", "python", "--dtype", "float32", "--backend-version", "1.2.1") == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == \
        ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]


def test_serving_needs_tensorrt_llm_and_says_so_in_one_line(tiny_gpt2, tmp_path, capsys):
    """Bad input: forge serve of the tensorrtllm target's repository where TensorRT-LLM is not installed."""
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out) == 0
    capsys.readouterr()
    assert main(["serve", str(out)]) == 3
    err = capsys.readouterr().err.strip()
    assert "runs on TensorRT-LLM's LLM API" in err and "--docker" in err and "--target python" in err
    assert len(err.splitlines()) == 1
    assert main(["serve", str(out), "--docker"]) == 1  # no NGC tritonserver release ships it yet
    assert "--image" in capsys.readouterr().err
    assert main(["serve", str(out), "--docker", "--image", "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"]) == 0
    assert "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3" in capsys.readouterr().out
    assert main(["serve", str(out), "--docker", "--image", "x; rm -rf /"]) == 2


# -- model.py before the LLM API call ------------------------------------------------------------------

def strings(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def request(**tensors) -> dict[str, np.ndarray]:
    base = {"text_input": strings("What is the capital of France?")}
    for name, value in tensors.items():
        base[name] = value if isinstance(value, np.ndarray) else np.array([value])
    return base


def test_request_tensors_map_onto_sampling_params_keywords():
    parsed = forge_llmapi.parse(request(
        sampling_param_max_tokens=np.array([20], np.int32), sampling_param_temperature=np.array([0.5], np.float32),
        sampling_param_top_k=np.array([4], np.int32), sampling_param_top_p=np.array([0.9], np.float32),
        sampling_param_seed=np.array([7], np.uint64), sampling_param_best_of=np.array([1], np.int32),
        sampling_param_frequency_penalty=np.array([0.1], np.float32),
        sampling_param_presence_penalty=np.array([0.2], np.float32),
        sampling_param_exclude_input_from_output=np.array([True]), sampling_param_stop=strings("Paris", "."),
        sampling_param_return_perf_metrics=np.array([True]), return_finish_reason=np.array([True])),
        decoupled=False)
    assert parsed.sampling == {"max_tokens": 20, "temperature": 0.5, "top_k": 4, "top_p": pytest.approx(0.9),
                               "seed": 7, "best_of": 1, "frequency_penalty": pytest.approx(0.1),
                               "presence_penalty": pytest.approx(0.2), "exclude_input_from_output": True,
                               "stop": ["Paris", "."], "return_perf_metrics": True}
    for keyword in parsed.sampling:  # SamplingParams is keyword-only: an unknown keyword is a TypeError there
        assert keyword in SAMPLING_FIELDS, keyword
    assert "finish_reason" in parsed.returns and "first_token_time_ns" in parsed.returns
    assert not parsed.echo


def test_absent_inputs_take_the_interface_defaults():
    parsed = forge_llmapi.parse(request(), decoupled=False)
    assert parsed.sampling == {} and parsed.echo  # absent exclude_input_from_output: the prompt is echoed
    assert parsed.max_tokens == forge_llmapi.DEFAULT_MAX_TOKENS == SAMPLING_FIELDS["max_tokens"]["default"]
    assert parsed.returns == frozenset() and parsed.lora is None and not parsed.streaming


def test_lora_inputs_become_lora_request_keywords(tmp_path):
    (tmp_path / "lora" / "ja").mkdir(parents=True)
    parsed = forge_llmapi.parse(request(lora_id=np.array([3], np.uint64), lora_name=strings("ja"),
                                        lora_path=strings("ja")), decoupled=False)
    call = forge_llmapi.request_arguments(parsed, str(tmp_path))
    assert call["lora"] == {"lora_name": "ja", "lora_int_id": 3, "lora_path": str(tmp_path / "lora" / "ja"),
                            "lora_ckpt_source": "hf"}
    required = {name for name, f in LORA_FIELDS.items() if f.get("required")}
    assert required <= set(call["lora"]) <= set(LORA_FIELDS)


def test_engine_arguments_strip_triton_config_and_resolve_the_checkpoint(tiny_gpt2, tmp_path):
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out, "--decoupled") == 0
    model_dir = out / "tensorrt_llm" / "1"
    args, triton = forge_llmapi.engine_arguments("model.yaml", str(model_dir))
    assert triton == {"max_batch_size": 0, "decoupled": True}
    assert args["model"] == str(model_dir / "hf") and "triton_config" not in args
    (model_dir / "model.yaml").write_text("model: hf\ntriton_config:\n  decoupled: true\n")
    with pytest.raises(ValueError, match="triton_config.max_batch_size is required"):
        forge_llmapi.engine_arguments("model.yaml", str(model_dir))


@pytest.mark.parametrize("tensors, decoupled, message", [
    ({"image_url": strings("file:///etc/passwd")}, False, "only http(s) URLs and data: URIs"),
    ({"image_url": strings("/etc/passwd")}, False, "only http(s) URLs and data: URIs"),
    ({"lora_id": np.array([1], np.uint64), "lora_name": strings("a")}, False, "missing lora_path"),
    ({"lora_id": np.array([1], np.uint64), "lora_name": strings("a"), "lora_path": strings("a"),
      "lora_ckpt_source": strings("pickle")}, False, "lora_ckpt_source must be one of hf, nemo"),
    ({"streaming": np.array([True])}, False, "Streaming is only supported in decoupled mode."),
    ({"sampling_param_max_tokens": np.array([0], np.int32)}, False, "at least 1"),
    ({"sampling_param_top_p": np.array([1.5], np.float32)}, False, "in [0, 1]"),
    ({"sampling_param_temperature": np.array([np.nan], np.float32)}, False, "finite"),
    ({"sampling_param_max_tokens": np.array([1, 2], np.int32)}, False, "takes one value"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, False, "not valid UTF-8"),
])
def test_bad_requests_get_one_clear_error(tensors, decoupled, message):
    with pytest.raises(forge_llmapi.RequestError) as err:
        forge_llmapi.parse({**request(), **tensors}, decoupled=decoupled, multimodal=True)
    assert message in str(err.value)


def test_image_urls_are_refused_unless_the_model_is_multimodal():
    with pytest.raises(forge_llmapi.RequestError, match="not multimodal"):
        forge_llmapi.parse(request(image_url=strings("https://example.com/cat.png")), decoupled=False)
    parsed = forge_llmapi.parse(request(image_url=strings("data:image/png;base64,AAAA")), decoupled=False,
                                multimodal=True)
    assert forge_llmapi.request_arguments(parsed, "/tmp")["inputs"]["multi_modal_data"] == {
        "image": ["data:image/png;base64,AAAA"]}


def test_a_lora_path_outside_the_model_directory_is_refused(tmp_path):
    parsed = forge_llmapi.parse(request(lora_id=np.array([1], np.uint64), lora_name=strings("x"),
                                        lora_path=strings("../../etc")), decoupled=False)
    with pytest.raises(forge_llmapi.RequestError, match="leaves the model's lora/ directory"):
        forge_llmapi.request_arguments(parsed, str(tmp_path))


def test_responses_carry_text_and_only_what_was_asked():
    configured = {t.name: np.dtype(object) if t.dtype == "STRING" else np.dtype(t.dtype.lower().replace("fp", "float"))
                  for t in NEWEST.interface("tensorrt_llm").outputs}
    parsed = forge_llmapi.parse(request(return_finish_reason=np.array([True]),
                                        return_cumulative_logprob=np.array([True])), decoupled=False)
    out = forge_llmapi.outputs(forge_llmapi.Completion("Paris.", "stop", None, -1.5), parsed, configured)
    assert set(out) == {"text_output", "finish_reason", "cumulative_logprob"}
    assert out["text_output"].tolist() == [b"Paris."] and out["finish_reason"].tolist() == [b"stop"]
    assert out["cumulative_logprob"].dtype == np.float32 and out["cumulative_logprob"].tolist() == [-1.5]
    plain = forge_llmapi.outputs(forge_llmapi.Completion("Paris."), forge_llmapi.parse(request(), decoupled=False),
                                 configured)
    assert set(plain) == {"text_output"}


def test_the_served_model_file_uses_only_the_public_llm_api():
    """model.py imports LLM, SamplingParams and LoRARequest from their public modules, nothing private."""
    from forge import in_triton as served

    text = served.LLMAPI_MODEL.read_text()
    imports = [line.strip() for line in text.splitlines() if "tensorrt_llm" in line and "import" in line]
    assert imports == ["from tensorrt_llm import LLM, SamplingParams  # after the environment is settled (CUDA is "
                       "not fork-safe)", "from tensorrt_llm.executor import LoRARequest"]
    assert "generate_async" in text and "_mpi_session" not in text
    assert sys.modules.get("tensorrt_llm") is None


def test_deploy_gives_the_llm_api_its_gpus_on_one_node(tiny_gpt2, tmp_path, capsys):
    """The LLM API starts tp × pp workers from one tritonserver: one task, tp × pp GPUs. Bad inputs: too few
    GPUs per node, several nodes, and (without --container-image) a release no NGC container ships."""
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out, "--tp", "2") == 0
    image = ["--container-image", "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"]
    script = tmp_path / "serve.sbatch"
    assert main(["deploy", "slurm", str(out), *image, "--out", str(script)]) == 0
    text = script.read_text()
    assert "#SBATCH --ntasks=1" in text and "#SBATCH --gpus-per-node=2" in text
    assert "--container-image=nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3" in text
    capsys.readouterr()
    assert main(["deploy", "slurm", str(out), *image, "--gpus-per-node", "1", "--out", str(script)]) == 2
    assert "needs 2 GPUs (tp × pp)" in capsys.readouterr().err
    assert main(["deploy", "slurm", str(out), "--out", str(script)]) == 1
    assert "no NGC tritonserver container ships TensorRT-LLM v1.3.0rc29" in capsys.readouterr().err


def test_deploy_of_a_python_target_build_takes_the_newest_container(tiny_gpt2, tmp_path, capsys):
    """The python target records the newest LLM-API release, which no NGC container ships, but runs on no
    TensorRT-LLM: deploy takes the newest tritonserver container of the profile table, where the tensorrtllm
    target's build (above) is refused."""
    out = tmp_path / "repo"
    assert build(tiny_gpt2, out, "--target", "python") == 0
    newest = max((p for p in profiles.PROFILES.values() if p.container), key=lambda p: p.triton)
    compose = tmp_path / "compose.yaml"
    assert main(["deploy", "compose", str(out), "--out", str(compose)]) == 0
    assert newest.container in compose.read_text() and newest.container in capsys.readouterr().out


def test_dynamic_batching_options_are_refused_on_the_python_targets_llmapi_model(tiny_gpt2, tmp_path, capsys):
    """Bad input: -o max_queue_delay_microseconds on a model without a batch dimension (nothing would read it)."""
    assert build(tiny_gpt2, tmp_path / "repo", "--target", "python", "-o", "max_queue_delay_microseconds=100") == 2
    assert "does not use" in capsys.readouterr().err and not (tmp_path / "repo").exists()
