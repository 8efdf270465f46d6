"""The decoder families' -o contract: every fill_template key is declared, per target; nothing is dropped."""

from __future__ import annotations

import json

import pytest

from forge.cli import main

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own


@pytest.mark.parametrize("args, message", [
    (["-o", "enable_kv_cach_reuse=true"], "did you mean enable_kv_cache_reuse"),
    (["-o", "triton_max_batch_size=8"], "unknown -o triton_max_batch_size for family gpt"),
    (["--target", "python", "-o", "kv_cache_host_memory_bytes=1000"],
     "-o kv_cache_host_memory_bytes has no effect on --target python of family gpt; it is read by --target tensorrtllm"),
    (["--target", "python", "-o", "paged_kv_cache=false", "-o", "enable_kv_cache_reuse=true"],
     "-o enable_kv_cache_reuse=true shares blocks of a paged KV cache, and -o paged_kv_cache=false"),
    (["--target", "python", "-o", "cuda_graphs=false", "-o", "paged_kv_cache=true"],
     "-o paged_kv_cache=true belongs to the CUDA-graph decoder, and -o cuda_graphs=false turns"),
    (["--target", "python", "--tp", "2", "-o", "cuda_graphs=false", "-o", "paged_kv_cache=true"],
     "-o paged_kv_cache=true belongs to the CUDA-graph decoder"),
    (["--target", "python", "-o", "kv_cache_free_gpu_mem_fraction=1.5"], "kv_cache_free_gpu_mem_fraction"),
    (["--target", "python", "-o", "batching_strategy=V1"], "-o batching_strategy has no effect on --target python"),
    (["--target", "python", "-o", "kv_cache_onboard_blocks=true"], "has no effect on --target python"),
    (["--target", "python", "--pp", "2"], "--target python runs tensor parallel only; --pp 2 applies to TensorRT-LLM"),
    (["-o", "batching_strategy=V2"], "-o batching_strategy=V2 is not valid; choose one of"),
    (["-o", "max_queue_delay_microseconds=soon"], "-o max_queue_delay_microseconds takes an integer"),
    (["--target", "tensorrtllm", "-o", "device=cuda"], "-o device has no effect on --target tensorrtllm"),
    (["--target", "hf-pipeline", "-o", "bls=true"], "-o bls has no effect on --target hf-pipeline"),
    (["--target", "hf-pipeline", "-o", "compute_dtype=bfloat16"], "-o compute_dtype has no effect on --target hf-pipeline"),
    (["--target", "hf-pipeline", "--quant", "w8a16"], "--target hf-pipeline serves the checkpoint's own weights"),
    (["--target", "hf-pipeline", "--tp", "2"], "cannot split across ranks for --target hf-pipeline"),
    (["--target", "hf-pipeline", "--max-batch-size", "4"], "--max-batch-size has no effect on --target hf-pipeline"),
    (["--target", "python", "-o", "compute_dtype=int8"], "compute_dtype"),
    (["--target", "python", "-o", "cuda_graphs=maybe"], "-o cuda_graphs=maybe is not valid"),
    (["--target", "tensorrtllm", "-o", "cuda_graphs=true"], "-o cuda_graphs has no effect on --target tensorrtllm"),
    (["--target", "python", "--tp", "2", "-o", "overlap_steps=true", "-o", "paged_kv_cache=true"],
     "-o overlap_steps=true overlaps the steps of the CUDA-graph decoder's static slots; -o paged_kv_cache=true"),
    (["--target", "python", "-o", "cuda_graphs=false", "-o", "torch_compile=true"],
     "-o torch_compile=true belongs to the CUDA-graph decoder, and -o cuda_graphs=false turns"),
    (["--target", "python", "-o", "torch_compile=always"], "-o torch_compile=always is not valid"),
    (["--target", "python", "-o", "engine_process=maybe"], "-o engine_process=maybe is not valid"),
    (["--target", "tensorrtllm", "-o", "engine_process=true"], "-o engine_process has no effect on --target tensorrtllm"),
    (["--target", "tensorrtllm", "-o", "torch_compile=true"], "-o torch_compile has no effect on --target tensorrtllm"),
    (["-o", "max_num_images=2"], "unknown -o max_num_images for family gpt"),
    (["--backend-version", "v0.5.0", "-o", "enable_kv_cache_reuse=true"],
     "-o enable_kv_cache_reuse is not a parameter of tensorrtllm_backend"),
])
def test_undeclared_or_ignored_options_are_refused(tiny_gpt2, tmp_path, capsys, args, message):
    """Bad inputs tried: misspelled keys, a Triton config field, engine parameters on the python target,
    --tp on the python target, a bad choice, a word for an integer, a key of another backend version."""
    out = tmp_path / "repo"
    code = main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out), "--dry-run", *args])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1


def test_options_lists_fill_template_keys_per_target(capsys):
    assert main(["options", "--family", "llama", "--target", "python", "--json"]) == 0
    python = {row["name"] for row in json.loads(capsys.readouterr().out)}
    assert {"exclude_input_in_output", "decoupled", "device", "end_id", "max_queue_delay_microseconds",
            "paged_kv_cache", "enable_kv_cache_reuse", "kv_cache_free_gpu_mem_fraction"} <= python
    assert not {"batching_strategy", "kv_cache_onboard_blocks", "enable_chunked_context"} & python
    assert main(["options", "--family", "llama", "--target", "tensorrtllm", "--json"]) == 0
    engine = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert engine["batching_strategy"]["choices"] == ["inflight_fused_batching", "inflight_batching", "V1"]
    assert "device" not in engine


def test_encoders_refuse_tensor_parallelism(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    code = main(["build", "--backend-version", ENGINE, "--family", "minilm", "--model", str(model), "--out", str(tmp_path / "o"), "--tp", "2"])
    assert code == 2
    assert "family 'minilm' cannot split across ranks" in capsys.readouterr().err


def test_scheduler_policy_values_follow_the_release(tiny_gpt2, tmp_path, capsys):
    """v0.5.0 (seed 000) called the no-evict policy guaranteed_completion; v0.6.1 renamed it."""
    def build(version, policy):
        return main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(tmp_path / version),
                     "--dry-run", "--backend-version", version, "-o", f"batch_scheduler_policy={policy}"])

    assert build("v0.5.0", "guaranteed_completion") == 0
    assert build("v0.13.0", "guaranteed_no_evict") == 0
    capsys.readouterr()
    assert build("v0.13.0", "guaranteed_completion") == 2
    assert "is not valid for tensorrtllm_backend v0.13.0; choose one of guaranteed_no_evict" in capsys.readouterr().err
    assert build("v0.5.0", "guaranteed_no_evict") == 2
    assert "choose one of guaranteed_completion, max_utilization" in capsys.readouterr().err


def test_hf_pipeline_target_writes_the_seed_model_as_the_ensemble(tiny_gpt2, tmp_path):
    """--target hf-pipeline: one python model named ensemble, no dynamic batching, one instance, no export."""
    from forge import tritonconfig

    out = tmp_path / "repo"
    assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--target", "hf-pipeline", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["ensemble"]
    config = tritonconfig.read(out / "ensemble")
    assert config.backend == "python" and config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert [i.name for i in config.input][:2] == ["text_input", "max_tokens"]
    assert config.parameters["dtype"].string_value == "float16"  # as seed 000 writes it
    assert (out / "ensemble" / "1" / "hf" / "config.json").is_file()


def test_cuda_graphs_choice_reaches_the_served_model_as_written(tiny_gpt2, tmp_path):
    """-o cuda_graphs=true/false arrive from the command line as booleans; the model reads the choice's text."""
    from forge import tritonconfig

    for value in ("true", "false", "auto"):
        out = tmp_path / value
        assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--target", "python", "--out", str(out),
                     "-o", f"cuda_graphs={value}"]) == 0
        config = tritonconfig.read(out / "tensorrt_llm")
        assert config.parameters["cuda_graphs"].string_value == value
        manifest = json.loads((out / "forge-manifest.json").read_text())
        assert manifest["spec"]["options"]["cuda_graphs"] == value  # the manifest records the choice, not True


def test_sender_threads_reach_the_served_model_and_zero_is_refused(tiny_gpt2, tmp_path, capsys):
    """-o sender_threads: 4 by default, the chosen count in the model's parameters; 0 and a word are refused
    before anything is written."""
    from forge import tritonconfig

    for args, expected in (([], "4"), (["-o", "sender_threads=2"], "2")):
        out = tmp_path / f"senders{expected}"
        assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--target", "python", "--out", str(out),
                     *args]) == 0
        assert tritonconfig.read(out / "tensorrt_llm").parameters["sender_threads"].string_value == expected
    for bad in ("0", "many"):
        out = tmp_path / f"bad-{bad}"
        assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--target", "python", "--out", str(out),
                     "-o", f"sender_threads={bad}"]) != 0
        assert "sender_threads" in capsys.readouterr().err and not out.exists()


def test_engine_process_reaches_the_served_model(tiny_gpt2, tmp_path):
    """-o engine_process: auto by default (the model decides: on where it decodes on a GPU), the choice in the
    model's parameters, at --tp 2 too (the engine process then leads the ranks)."""
    from forge import tritonconfig

    for args, expected in (([], "auto"), (["-o", "engine_process=false"], "false"),
                           (["-o", "engine_process=true"], "true"), (["--tp", "2"], "auto"),
                           (["--tp", "2", "-o", "engine_process=true"], "true")):
        out = tmp_path / f"hosted-{expected}-{len(args)}"
        assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--target", "python", "--out", str(out),
                     *args]) == 0
        assert tritonconfig.read(out / "tensorrt_llm").parameters["engine_process"].string_value == expected


def test_overlap_steps_reach_the_served_model_and_what_cannot_overlap_is_refused(tiny_gpt2, tmp_path, capsys):
    """-o overlap_steps: auto by default, the choice in the model's parameters (at --tp 2 too); =true with a paged
    cache or with -o cuda_graphs=false, and a value outside auto/true/false, are refused before anything is
    written."""
    from forge import tritonconfig

    for args, expected in (([], "auto"), (["-o", "overlap_steps=false"], "false"),
                           (["-o", "overlap_steps=true", "--tp", "2"], "true")):
        out = tmp_path / f"overlap-{expected}"
        assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--target", "python", "--out", str(out),
                     *args]) == 0
        assert tritonconfig.read(out / "tensorrt_llm").parameters["overlap_steps"].string_value == expected
    for bad in (["-o", "overlap_steps=true", "-o", "paged_kv_cache=true"],
                ["-o", "overlap_steps=true", "-o", "cuda_graphs=false"], ["-o", "overlap_steps=sometimes"]):
        out = tmp_path / "bad"
        assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--target", "python", "--out", str(out),
                     *bad]) != 0
        assert "overlap_steps" in capsys.readouterr().err and not out.exists()
