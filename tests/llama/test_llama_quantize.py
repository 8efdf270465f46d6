"""quantize: declared weight-only algorithms, modelopt INT4-AWQ / FP8 / INT8-KV, recipes and refusals."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from llama_models import make_llama

import forge_llama
from forge.cli import main
from forge.context import BuildContext, StageRecord
from forge.errors import UsageError
from forge.llm import checkpoint, weight_quant as quantize
from forge.llm.quantlayout import MODELOPT_KEYS
from forge.llm.reference import ReferenceModel, dequantize_awq, load_rank, max_abs_diff
from forge.spec import BuildSpec

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

ADAPTER = forge_llama.ADAPTER
IDS = [5, 9, 22, 40, 41, 77, 3, 60]
SMOLLM2 = {"family": "llama", "tp": 1, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3, "head_size": 64,
           "intermediate_size": 1536, "num_layers": 30, "pp": 1}


@pytest.fixture(autouse=True)
def two_threads():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def spec_for(model: Path, quant=(), **kw) -> BuildSpec:
    return BuildSpec(families=["llama"], model=model, out=Path("unused"), quant=tuple(quant), **kw)


def ctx_for(spec: BuildSpec, workdir: Path, stage: str) -> BuildContext:
    workdir.mkdir(parents=True, exist_ok=True)
    return BuildContext(spec=spec, target="tensorrtllm", workdir=workdir, record=StageRecord(stage, ""))


def run_stages(model: Path, tmp_path: Path, quant, **kw):
    spec = spec_for(model, quant, **kw)
    exported = checkpoint.export(ADAPTER, model, ctx_for(spec, tmp_path / "export", "export"))
    ctx = ctx_for(spec, tmp_path / "quantize", "quantize")
    return exported, quantize.quantize(ADAPTER, model, exported, ctx), ctx


def build(model: Path, out: Path, *args) -> int:
    return main(["build", "--backend-version", ENGINE, "--family", "llama", "--model", str(model), "--out", str(out), *map(str, args)])


def refused(capsys, out: Path, code: int, *fragments: str) -> None:
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, line
    for fragment in fragments:
        assert fragment in line, line
    assert not out.exists()


# -- declared weight-only ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode,algo", [("w8a16", "W8A16"), ("w4a16", "W4A16")])
def test_weight_only_is_declared_in_the_checkpoint(wide_llama, tmp_path, mode, algo):
    """w8a16/w4a16: same float rank files (shared, not copied), config declares the algorithm."""
    exported, quantized, ctx = run_stages(wide_llama, tmp_path, [mode], tp=2)
    config = json.loads((quantized.path / "config.json").read_text())
    assert config["quantization"] == {"quant_algo": algo, "kv_cache_quant_algo": None}
    for r in range(2):
        a, b = exported.path / f"rank{r}.safetensors", quantized.path / f"rank{r}.safetensors"
        assert os.path.samefile(a, b) or a.read_bytes() == b.read_bytes()
    assert quantized.meta["quant"]["quant_algo"] == algo
    assert quantized.meta["quant"]["method"].startswith("declared")
    assert ctx.record.notes["quantize"]["modes"] == (mode,)
    for key in ("architecture", "tp", "pp", "world_size", "num_kv_heads", "max_position_embeddings"):
        assert quantized.meta[key] == exported.meta[key]


def test_two_weight_algorithms_refused(tiny_llama, tmp_path, capsys):
    """Bad input: --quant w8a16,int4_awq asks for two weight formats at once."""
    out = tmp_path / "repo"
    refused(capsys, out, build(tiny_llama, out, "--quant", "w8a16,int4_awq"), "both quantize the weights")


def test_recipe_combinations():
    """int8_kv combines with any weight mode; weight modes exclude each other."""
    meta = {**SMOLLM2}
    kv_only = quantize.make_recipe(["int8_kv"], meta, {})
    assert kv_only.quantization() == {"quant_algo": None, "kv_cache_quant_algo": "INT8"}
    recipe = quantize.make_recipe(["w4a16", "int8_kv"], meta, {})
    assert (recipe.quant_algo, recipe.kv_cache_quant_algo, recipe.calibrate) == ("W4A16", "INT8", True)
    assert quantize.make_recipe(["w8a16"], meta, {}).calibrate is False
    with pytest.raises(UsageError, match="both quantize the weights"):
        quantize.make_recipe(["fp8", "w4a16"], meta, {})
    recipe = quantize.make_recipe(["fp8"], meta, {"group_size": 64})
    assert recipe.group_size is None and "ignored" in recipe.notes[0]


# -- AWQ block size ----------------------------------------------------------------------------------

def test_awq_block_size_explained_for_smollm2_shapes():
    """SmolLM2 (hidden 576): the default 128 does not fit, 64 is chosen and the reason recorded."""
    recipe = quantize.make_recipe(["int4_awq"], SMOLLM2, {})
    assert recipe.group_size == 64
    assert "128 does not divide" in recipe.notes[0] and "576" in recipe.notes[0]
    with pytest.raises(UsageError, match="block size 128 does not divide .*= 576") as err:
        quantize.make_recipe(["int4_awq"], SMOLLM2, {"group_size": 128})
    assert "--group-size 64" in err.value.one_line()
    assert quantize.make_recipe(["int4_awq"], {**SMOLLM2, "tp": 3}, {"group_size": 64}).group_size == 64
    per_rank = {**SMOLLM2, "tp": 2, "hidden_size": 1024, "num_heads": 16, "num_kv_heads": 16,
                "intermediate_size": 2752}
    with pytest.raises(UsageError, match=r"mlp.proj .*2752/2.* = 1376") as err:  # hidden fits 128, 2752/2 not
        quantize.make_recipe(["int4_awq"], per_rank, {"group_size": 128})
    assert "No block size fits" in err.value.one_line()  # 32 divides 1376, but TensorRT-LLM pads 2752 to 128·2
    with pytest.raises(UsageError, match=r"multiples of max\(64, group size 32\)·tp = 128 .*mlp.fc out = 2752"):
        quantize.make_recipe(["int4_awq"], per_rank, {"group_size": 32})
    for bad in (0, "x"):
        with pytest.raises(UsageError, match="--group-size"):
            quantize.make_recipe(["int4_awq"], SMOLLM2, {"group_size": bad})


def test_awq_block_size_refused_through_the_cli(tmp_path, capsys):
    """Bad input: --group-size 128 for hidden 96; the one line says which width it does not divide."""
    model = make_llama(tmp_path / "m", hidden=96, heads=8, kv_heads=2, inter=192)
    out = tmp_path / "repo"
    refused(capsys, out, build(model, out, "--quant", "int4_awq", "--group-size", "128"),
            "block size 128 does not divide", "= 96", "No block size fits", "--quant fp8")


# -- nvidia-modelopt ---------------------------------------------------------------------------------

def test_awq_checkpoint_matches_modelopt_fake_quantized_model(calib_llama, tmp_path):
    """INT4-AWQ at tp 2: dequantized rank weights equal modelopt's fake-quantized weights, logits agree.

    The comparison is with the model as it is after the export, because modelopt's export re-smooths
    fused layers (Q/K/V, gate/up) to one shared pre-quant scale in place.
    """
    import torch

    # TensorRT-LLM would pad these widths (64 is below 128·tp): this checks modelopt's numbers, not a loadable layout
    recipe = quantize.Recipe(("int4_awq",), quant_algo="W4A16_AWQ", group_size=32, calibrate=True)
    model, tokenizer = quantize.load_for_calibration(calib_llama, spec_for(calib_llama))
    quantize.calibrate(model, tokenizer, recipe, quantize.calibration_texts(None, 8))
    out = tmp_path / "awq"
    config = quantize.export_modelopt(ADAPTER, model, out, "float16", 2, 1)
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ" and config["quantization"]["group_size"] == 32
    ranks = [load_rank(out / f"rank{r}.safetensors") for r in range(2)]

    def fake(module):
        return module.weight_quantizer(module.weight).detach().numpy()

    for i, layer in enumerate(model.model.layers):
        p = f"transformer.layers.{i}"
        deq = [dequantize_awq(r, f"{p}.attention.qkv", 32) for r in ranks]
        q, k, v = (fake(getattr(layer.self_attn, f"{n}_proj")) for n in "qkv")
        for r in range(2):  # per rank: its 2 Q heads and its KV head
            want = np.concatenate([q[r * 32:(r + 1) * 32], k[r * 16:(r + 1) * 16], v[r * 16:(r + 1) * 16]])
            assert max_abs_diff(deq[r], want) < 1e-6
        for name, module, axis in (("attention.dense", layer.self_attn.o_proj, 1), ("mlp.fc", layer.mlp.gate_proj, 0),
                                   ("mlp.gate", layer.mlp.up_proj, 0), ("mlp.proj", layer.mlp.down_proj, 1)):
            full = np.concatenate([dequantize_awq(r, f"{p}.{name}", 32) for r in ranks], axis=axis)
            assert max_abs_diff(full, fake(module)) < 1e-6, name
            scale = module.input_quantizer.pre_quant_scale.detach().numpy().reshape(-1)
            stored = [r[f"{p}.{name}.prequant_scaling_factor"] for r in ranks]
            stored = np.concatenate(stored) if axis == 1 else stored[0]
            assert max_abs_diff(stored, scale) < 2e-3 * np.abs(scale).max(), name  # stored as float16
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0].numpy()
    got = ReferenceModel(out).logits(IDS, vocab_size=128)
    assert max_abs_diff(got, expected) < 1e-2 * np.abs(expected).max()
    staged = tmp_path / "awq-pp2"  # the same model over 2 × 2 ranks
    assert quantize.export_modelopt(ADAPTER, model, staged, "float16", 2, 2)["mapping"]["pp_size"] == 2
    assert max_abs_diff(ReferenceModel(staged).logits(IDS, vocab_size=128), expected) < 1e-2 * np.abs(expected).max()


def test_int8_kv_with_calibration_file(calib_llama, tmp_path):
    """int8_kv alone: modelopt writes per-layer KV scales; --calib-data lines are the samples."""
    calib = tmp_path / "calib.txt"
    calib.write_text("first sample about cats\n\nsecond sample about dogs\nthird one\n")
    _, quantized, ctx = run_stages(calib_llama, tmp_path, ["int8_kv"], tp=2, options={"calib_data": calib})
    config = json.loads((quantized.path / "config.json").read_text())
    assert config["quantization"]["kv_cache_quant_algo"] == "INT8" and config["quantization"]["quant_algo"] is None
    rank = load_rank(quantized.path / "rank1.safetensors")
    assert {f"transformer.layers.{i}.attention.kv_cache_scaling_factor" for i in range(2)} <= set(rank)
    calibration = quantized.meta["quant"]["calibration"]
    assert calibration["samples"] == 3 and calibration["data"] == str(calib)
    assert ctx.record.notes["quantize"]["method"] == "nvidia-modelopt"


def test_weight_only_with_int8_kv(calib_llama, tmp_path):
    """w8a16 + int8_kv: KV scales calibrated by modelopt, the weight algorithm declared for trtllm-build."""
    _, quantized, _ = run_stages(calib_llama, tmp_path, ["w8a16", "int8_kv"], tp=1)
    config = json.loads((quantized.path / "config.json").read_text())
    assert (config["quantization"]["quant_algo"], config["quantization"]["kv_cache_quant_algo"]) == ("W8A16", "INT8")
    assert quantized.meta["quant"]["modes"] == ["w8a16", "int8_kv"]


def test_fp8_checkpoint_evaluates_close_to_fake_quantized_model(calib_llama, tmp_path):
    """fp8: FP8 weights with per-tensor scales; dequantized, they reproduce the fake-quantized logits."""
    import torch

    recipe = quantize.make_recipe(["fp8"], {}, {})
    model, tokenizer = quantize.load_for_calibration(calib_llama, spec_for(calib_llama))
    quantize.calibrate(model, tokenizer, recipe, quantize.calibration_texts(None, 8))
    out = tmp_path / "fp8"
    config = quantize.export_modelopt(ADAPTER, model, out, "float16", 1, 1)
    assert config["quantization"]["quant_algo"] == "FP8"
    from forge.llm.tensorio import SafetensorsFile

    f = SafetensorsFile(out / "rank0.safetensors")
    assert f.refs["transformer.layers.0.mlp.fc.weight"].tag == "F8_E4M3"
    f.close()
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0].numpy()
    got = ReferenceModel(out).logits(IDS, vocab_size=128)  # activations unquantized here
    assert max_abs_diff(got, expected) < 0.1 * np.abs(expected).max()


def test_calibration_needs_a_tokenizer(tiny_llama, tmp_path, capsys):
    """Bad input: fp8 on a checkpoint without tokenizer files."""
    out = tmp_path / "repo"
    refused(capsys, out, build(tiny_llama, out, "--quant", "fp8"), "calibration needs the checkpoint's tokenizer")


def test_missing_calibration_file(calib_llama, tmp_path, capsys):
    """Bad input: --calib-data points at a file that does not exist."""
    out = tmp_path / "repo"
    missing = tmp_path / "nope.txt"
    refused(capsys, out, build(calib_llama, out, "--quant", "int8_kv", "--calib-data", missing),
            f"cannot read --calib-data {missing}")


def test_empty_calibration_file(calib_llama, tmp_path):
    """Bad input: --calib-data with only blank lines."""
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(UsageError, match="has no text"):
        quantize.calibration_texts(empty, 10)


@pytest.mark.parametrize("mode", ["int4_awq", "fp8", "int8_kv"])
def test_quantized_config_is_forges_own(wide_llama, tmp_path, mode):
    """Regression (issue 14): modelopt's config.json is its view of the model; forge keeps its export's
    (RoPE base and scaling, activation, architecture) and takes only quantization and embedding layout."""
    model = tmp_path / "m"
    shutil.copytree(wide_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}
    (model / "config.json").write_text(json.dumps(config))
    exported, quantized, _ = run_stages(model, tmp_path, [mode], tp=2, options={"calib_size": 4})
    own = json.loads((exported.path / "config.json").read_text())
    written = json.loads((quantized.path / "config.json").read_text())
    assert written["rotary_base"] == 50000.0 and written["rotary_scaling"]["type"] == "linear"
    differ = {k for k in own.keys() | written.keys() if own.get(k) != written.get(k)}
    assert differ <= {*MODELOPT_KEYS, "producer"}, differ
    assert written["quantization"]["quant_algo"] == quantize.make_recipe([mode], exported.meta, {}).quant_algo
