"""``--target vllm``: the model directory Triton's vLLM backend loads, and what a build refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import build  # noqa: E402

from forge.profiles import vllm_releases  # noqa: E402


def _config(model_dir: Path):
    from forge.tritonconfig import read

    return read(model_dir)


def test_the_model_is_the_vllm_backends_interface_decoupled_without_batching(tiny_llama, tmp_path):
    repo = build(tiny_llama, tmp_path / "repo")
    config = _config(repo / "ensemble")
    assert config.backend == "vllm" and config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled
    assert config.instance_group[0].kind == config.instance_group[0].KIND_MODEL
    newest = vllm_releases.interface()
    from forge.tritonconfig import dtype_name

    inputs = [(t.name, dtype_name(t.data_type), tuple(t.dims), t.optional) for t in config.input]
    outputs = [(t.name, dtype_name(t.data_type), tuple(t.dims)) for t in config.output]
    assert inputs == list(newest.inputs)
    assert outputs == [t[:3] for t in newest.outputs]
    assert [t[0] for t in newest.inputs] == [
        "text_input", "image", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
        "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens", "return_num_output_tokens",
        "embedding_request"]
    manifest = json.loads((repo / "forge-manifest.json").read_text())
    assert "26.01-vllm-python-py3" in json.dumps(manifest)


def test_model_json_holds_the_flags_and_options_and_points_at_the_copied_checkpoint(tiny_llama, tmp_path):
    repo = build(tiny_llama, tmp_path / "repo", "--dtype", "float32", "-o", "max_model_len=96",
                 "-o", "gpu_memory_utilization=0.5", "-o", "enable_prefix_caching=true",
                 "-o", "enable_chunked_prefill=false", "-o", "max_num_seqs=4", "-o", "enforce_eager=true")
    doc = json.loads((repo / "ensemble" / "1" / "model.json").read_text())
    assert doc == {"model": str((repo / "ensemble" / "1" / "hf").resolve()), "tensor_parallel_size": 1,
                   "pipeline_parallel_size": 1, "dtype": "float32", "max_model_len": 96,
                   "gpu_memory_utilization": 0.5, "enable_prefix_caching": True, "enable_chunked_prefill": False,
                   "max_num_seqs": 4, "enforce_eager": True}
    copied = repo / "ensemble" / "1" / "hf"
    assert (copied / "model.safetensors").is_file() and not (copied / "model.safetensors").is_symlink()
    assert (copied / "tokenizer.json").is_file() and (copied / "config.json").is_file()
    params = _config(repo / "ensemble").parameters
    assert params["max_seq_len"].string_value == "96" and params["tokenizer_dir"].string_value == "hf"


def test_tensor_parallel_and_the_checkpoints_quantization_reach_model_json(tiny_llama, tmp_path):
    import shutil

    quantized = tmp_path / "quantized"
    shutil.copytree(tiny_llama, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (quantized / "config.json").write_text(json.dumps(config))
    repo = build(quantized, tmp_path / "repo", "--tp", "2")
    doc = json.loads((repo / "ensemble" / "1" / "model.json").read_text())
    assert doc["tensor_parallel_size"] == 2 and doc["quantization"] == "fp8" and "dtype" not in doc


def test_lora_writes_multi_lora_json_and_the_limits(tiny_llama, tiny_lora, tmp_path):
    repo = build(tiny_llama, tmp_path / "repo", "--lora", f"alpha={tiny_lora}", "--lora", f"beta={tiny_lora}")
    version = repo / "ensemble" / "1"
    doc = json.loads((version / "model.json").read_text())
    assert doc["enable_lora"] is True and doc["max_loras"] == 2 and doc["max_lora_rank"] == 8  # rank 4 → 8
    adapters = json.loads((version / "multi_lora.json").read_text())
    assert adapters == {name: str((version / "lora" / name).resolve()) for name in ("alpha", "beta")}
    for name in adapters:
        assert (version / "lora" / name / "adapter_model.safetensors").is_file()
        assert (version / "lora" / name / "adapter_config.json").is_file()
    repo = build(tiny_llama, tmp_path / "repo2", "--lora", f"alpha={tiny_lora}", "-o", "max_lora_rank=16",
                 "-o", "max_loras=1")
    doc = json.loads((repo / "ensemble" / "1" / "model.json").read_text())
    assert doc["max_lora_rank"] == 16 and doc["max_loras"] == 1


BAD = [
    (["-o", "bogus_key=1"], "unknown -o bogus_key"),
    (["-o", "max_model_len=abc"], "-o max_model_len takes an integer"),
    (["-o", "max_model_len=0"], "-o max_model_len must be at least 1"),
    (["-o", "gpu_memory_utilization=1.5"], "-o gpu_memory_utilization must be in (0, 1]"),
    (["-o", "enforce_eager=maybe"], "-o enforce_eager takes true or false"),
    (["-o", "max_loras=2"], "LoRA limits without --lora adapters"),
    (["--instances", "2"], "--instances has no effect on --target vllm"),
    (["-o", "kv_cache_free_gpu_mem_fraction=0.5"], "has no effect on --target vllm"),
    (["--quant", "w8a16"], "--target vllm serves the checkpoint's own weights"),
    (["--max-seq-len", "64"], "Use -o max_model_len"),
    (["--max-beam-width", "2"], "has no beam search"),
    (["--backend-version", "24.09"], "is not a release of Triton's vLLM backend"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_build_inputs_are_refused_in_one_line(tiny_llama, tmp_path, capsys, extra, message):
    from forge.cli import main

    code = main(["build", "--family", "llama", "--target", "vllm", "--model", str(tiny_llama),
                 "--out", str(tmp_path / "repo"), *extra])
    err = capsys.readouterr().err
    assert code != 0 and message in err, err
    assert not (tmp_path / "repo").exists()


def test_lora_rank_above_the_asked_limit_is_refused(tiny_llama, tiny_lora, tmp_path, capsys):
    from forge.cli import main

    code = main(["build", "--family", "llama", "--target", "vllm", "--model", str(tiny_llama), "--out",
                 str(tmp_path / "repo"), "--lora", f"a={tiny_lora}", "-o", "max_lora_rank=1"])
    assert code != 0 and "below the rank of the largest --lora adapter (4)" in capsys.readouterr().err
    code = main(["build", "--family", "llama", "--target", "vllm", "--model", str(tiny_llama), "--out",
                 str(tmp_path / "repo"), "--lora", f"a={tiny_lora}", "-o", "max_lora_rank=12"])
    assert code != 0 and "not a rank vLLM allows" in capsys.readouterr().err


_CHECK = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
doc = json.load(open(sys.argv[1]))
config = AsyncEngineArgs(**doc).create_engine_config()
print(json.dumps({"max_model_len": config.model_config.max_model_len, "dtype": str(config.model_config.dtype),
                  "lora": config.lora_config is not None}))
"""


def test_model_json_is_accepted_by_vllms_own_engine_arguments(tiny_llama, tiny_lora, tmp_path, vllm_python):
    repo = build(tiny_llama, tmp_path / "repo", "--dtype", "float32", "-o", "max_model_len=96",
                 "-o", "enforce_eager=true", "--lora", f"alpha={tiny_lora}")
    model_json = repo / "ensemble" / "1" / "model.json"
    run = subprocess.run([vllm_python, "-c", _CHECK, str(model_json)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"max_model_len": 96, "dtype": "torch.float32",
                                                               "lora": True}
    doc = json.loads(model_json.read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**doc, "not_an_engine_argument": 1}))
    run = subprocess.run([vllm_python, "-c", _CHECK, str(tmp_path / "bad.json")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0 and "not_an_engine_argument" in run.stderr
