"""gpt export: GPT-2 → TensorRT-LLM unified checkpoint (layout, parity, dtypes, refusals)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gpt_models import hf_logits, make_gpt2

from forge.cli import main
from forge.llm.tensorio import SafetensorsFile
from forge.llm.reference import ReferenceModel, load_rank, max_abs_diff

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

IDS = [3, 17, 42, 99, 5, 8, 64, 100, 0, 31]


def export(model: Path, out: Path, *args) -> int:
    return main(["export", "--backend-version", ENGINE, "--family", "gpt", "--model", str(model), "--out", str(out), *map(str, args)])


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if lines else ""


def rewrite(model: Path, dst: Path, change) -> Path:
    """A copy of ``model`` whose tensors pass through ``change(dict) -> dict`` (safetensors, numpy)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model, dst)
    tensors = change(load_file(model / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_files_reproduce_transformers_logits(tiny_gpt2, tmp_path, tp, pp):
    """Column outputs concatenated, row outputs summed (bias once), stages chained: same logits as HF."""
    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, "--tp", tp, "--pp", pp, "--dtype", "float32") == 0
    assert sorted(p.name for p in out.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(tp * pp)]
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "GPTForCausalLM"
    assert config["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    expected = hf_logits(tiny_gpt2, IDS)
    got = ReferenceModel(out).logits(IDS)
    assert got.shape == expected.shape == (len(IDS), 101)
    assert max_abs_diff(got, expected) < 1e-4 * max(1.0, np.abs(expected).max())


def test_layout_matches_tensorrt_llm_loader(tiny_gpt2, tmp_path):
    """Names, per-rank shapes, Conv1D transposition, local layer indices, stage placement, vocab padding."""
    from safetensors.numpy import load_file

    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, "--tp", 2, "--pp", 2, "--dtype", "float32") == 0
    hf = load_file(tiny_gpt2 / "model.safetensors")
    ranks = [load_rank(out / f"rank{r}.safetensors") for r in range(4)]
    # stage 0 (ranks 0, 1): embeddings + layers 0, 1; stage 1 (ranks 2, 3): layer 2 as local 0 + ln_f, lm_head
    assert set(ranks[0]) == set(ranks[1])
    assert {"transformer.vocab_embedding.weight", "transformer.position_embedding.weight"} <= set(ranks[0])
    assert "lm_head.weight" not in ranks[0] and "transformer.layers.2.input_layernorm.weight" not in ranks[0]
    assert {"lm_head.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"} <= set(ranks[2])
    assert not any("vocab_embedding" in n for n in ranks[2])
    np.testing.assert_array_equal(ranks[2]["transformer.layers.0.input_layernorm.weight"],
                                  hf["transformer.h.2.ln_1.weight"])

    hidden, d = 48, 12
    c_attn = hf["transformer.h.0.attn.c_attn.weight"].T  # Conv1D [in, out] → [out, in]
    q, k, v = np.split(c_attn, 3)
    for r in (0, 1):
        qkv = ranks[r]["transformer.layers.0.attention.qkv.weight"]
        assert qkv.shape == (3 * hidden // 2, hidden)
        rows = slice(r * 2 * d, (r + 1) * 2 * d)  # 2 of the 4 heads per rank
        np.testing.assert_array_equal(qkv, np.concatenate([q[rows], k[rows], v[rows]]))
        dense = ranks[r]["transformer.layers.0.attention.dense.weight"]
        np.testing.assert_array_equal(dense, hf["transformer.h.0.attn.c_proj.weight"].T[:, r * 24:(r + 1) * 24])
        # row-parallel bias: whole on every rank (the runtime adds it once after the all-reduce)
        np.testing.assert_array_equal(ranks[r]["transformer.layers.0.attention.dense.bias"],
                                      hf["transformer.h.0.attn.c_proj.bias"])
        assert ranks[r]["transformer.layers.0.mlp.fc.weight"].shape == (4 * hidden // 2, hidden)
        assert ranks[r]["transformer.layers.0.mlp.proj.weight"].shape == (hidden, 4 * hidden // 2)
    # vocab 101 padded to 102 and split; the padding row is zero; tied lm_head written explicitly
    head = np.concatenate([ranks[2]["lm_head.weight"], ranks[3]["lm_head.weight"]])
    assert head.shape == (102, hidden)
    np.testing.assert_array_equal(head[:101], hf["transformer.wte.weight"])
    assert not head[101].any()
    np.testing.assert_array_equal(ranks[0]["transformer.vocab_embedding.weight"], hf["transformer.wte.weight"])


def test_files_are_valid_safetensors_with_metadata(tiny_gpt2, tmp_path):
    """The hand-written rank files load with the safetensors library itself."""
    from safetensors import safe_open

    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, "--tp", 2, "--dtype", "bfloat16") == 0
    with safe_open(out / "rank1.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        t = f.get_tensor("transformer.layers.1.mlp.fc.weight")
        assert str(t.dtype) == "torch.bfloat16" and tuple(t.shape) == (96, 48)


@pytest.mark.parametrize("dtype,tag,tolerance", [("float16", "F16", 2e-2), ("bfloat16", "BF16", 1e-1)])
def test_half_precision_exports(tiny_gpt2, tmp_path, dtype, tag, tolerance):
    """--dtype float16/bfloat16 stores every tensor in that dtype; logits stay close to float32."""
    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, "--tp", 2, "--dtype", dtype) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    f = SafetensorsFile(out / "rank0.safetensors")
    assert {ref.tag for ref in f.refs.values()} == {tag}
    f.close()
    expected = hf_logits(tiny_gpt2, IDS)
    assert max_abs_diff(ReferenceModel(out).logits(IDS), expected) < tolerance * np.abs(expected).max()


def test_hub_style_names_and_buffers(tiny_gpt2, tmp_path):
    """Hub GPT-2 files name tensors without "transformer." and carry attn.bias buffers: same checkpoint."""
    def hub_names(t):
        renamed = {k.removeprefix("transformer."): v for k, v in t.items()}
        renamed["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), dtype=np.float32))
        return renamed

    model = rewrite(tiny_gpt2, tmp_path / "hub", hub_names)
    assert export(model, tmp_path / "a", "--tp", 2, "--dtype", "float32") == 0
    assert export(tiny_gpt2, tmp_path / "b", "--tp", 2, "--dtype", "float32") == 0
    for r in (0, 1):
        a, b = load_rank(tmp_path / "a" / f"rank{r}.safetensors"), load_rank(tmp_path / "b" / f"rank{r}.safetensors")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_sharded_bfloat16_source(tiny_gpt2, tmp_path):
    """A sharded (index.json) bfloat16 checkpoint converts; bf16 → float32 is exact."""
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "sharded"
    model.mkdir()
    shutil.copy(tiny_gpt2 / "config.json", model)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(tiny_gpt2 / "model.safetensors").items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model / file, metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    out = tmp_path / "ckpt"
    assert export(model, out, "--tp", 2, "--dtype", "float32") == 0
    rank = load_rank(out / "rank0.safetensors")
    for ours, theirs in (("transformer.ln_f.weight", "transformer.ln_f.weight"),
                         ("transformer.layers.2.input_layernorm.weight", "transformer.h.2.ln_1.weight"),
                         ("transformer.vocab_embedding.weight", "transformer.wte.weight")):
        np.testing.assert_array_equal(rank[ours], tensors[theirs].float().numpy())


def test_dry_run_checks_but_writes_nothing(tiny_gpt2, tmp_path, cache, capsys):
    """--dry-run validates the checkpoint against the split but converts nothing."""
    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, "--tp", 2, "--dry-run") == 0
    assert not out.exists()
    assert not list(cache.rglob("rank*.safetensors"))
    assert export(tiny_gpt2, out, "--tp", 3, "--dry-run") == 2
    assert "cannot be split over --tp 3" in error_line(capsys)


# -- refusals: one line on stderr, exit 2, --out never created ---------------------------------------

def refused(capsys, out: Path, code: int, *fragments: str) -> None:
    line = error_line(capsys)
    assert code == 2, line
    assert line.startswith("forge: error:")
    for fragment in fragments:
        assert fragment in line, line
    assert not out.exists()


def test_refuses_unsupported_architecture(tiny_gpt2, tmp_path, capsys):
    """Bad input: a checkpoint of another architecture; the message lists the supported ones."""
    model = shutil.copytree(tiny_gpt2, tmp_path / "opt")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["OPTForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    refused(capsys, out, export(model, out), "'OPTForCausalLM' is not supported", "supported: GPT2LMHeadModel")


def test_refuses_heads_not_divisible_by_tp(tiny_gpt2, tmp_path, capsys):
    """Bad input: 4 heads cannot be split over tp 3."""
    out = tmp_path / "out"
    refused(capsys, out, export(tiny_gpt2, out, "--tp", 3), "4 attention heads cannot be split over --tp 3")


def test_refuses_more_stages_than_layers(tiny_gpt2, tmp_path, capsys):
    """Bad input: --pp 4 for a 3-layer model."""
    out = tmp_path / "out"
    refused(capsys, out, export(tiny_gpt2, out, "--pp", 4), "more pipeline stages than the model's 3 layers")


def test_refuses_config_weight_shape_disagreement(tiny_gpt2, tmp_path, capsys):
    """Bad input: config.json says n_embd 64 but the weights are 48 wide."""
    model = shutil.copytree(tiny_gpt2, tmp_path / "bad")
    config = json.loads((model / "config.json").read_text())
    config["n_embd"] = 64
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    refused(capsys, out, export(model, out), "has shape", "config.json implies", "does not match the weights")


def test_refuses_missing_tensors_and_names_them(tiny_gpt2, tmp_path, capsys):
    """Bad input: tensors of layer 1 are absent; the message names them."""
    model = rewrite(tiny_gpt2, tmp_path / "bad",
                    lambda t: {k: v for k, v in t.items() if not k.startswith("transformer.h.1.mlp")})
    out = tmp_path / "out"
    refused(capsys, out, export(model, out), "lacks 4 tensor(s)", "transformer.h.1.mlp.c_fc.weight")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_refuses_nan_and_inf_weights(tiny_gpt2, tmp_path, capsys, value):
    """Bad input: a NaN or Inf inside a weight; the message names the tensor."""
    def poison(t):
        t["transformer.h.2.mlp.c_proj.weight"][5, 7] = value
        return t

    model = rewrite(tiny_gpt2, tmp_path / "bad", poison)
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--tp", 2), "transformer.h.2.mlp.c_proj.weight contains NaN or Inf")


def test_refuses_float16_overflow(tiny_gpt2, tmp_path, capsys):
    """Bad input: a float32 value beyond float16's range asked to be stored as float16."""
    def big(t):
        t["transformer.wpe.weight"][0, 0] = 1e6
        return t

    model = rewrite(tiny_gpt2, tmp_path / "bad", big)
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--dtype", "float16"), "beyond the F16 range", "--dtype bfloat16")
    assert export(model, out, "--dtype", "bfloat16") == 0


def test_refuses_integer_weights(tiny_gpt2, tmp_path, capsys):
    """Bad input: an already-quantized (int8) tensor; forge converts floating-point checkpoints only."""
    def quantized(t):
        t["transformer.h.0.mlp.c_fc.weight"] = t["transformer.h.0.mlp.c_fc.weight"].astype(np.int8)
        return t

    model = rewrite(tiny_gpt2, tmp_path / "bad", quantized)
    out = tmp_path / "out"
    refused(capsys, out, export(model, out), "has dtype I8", "floating-point")


def test_refuses_attention_variants_tensorrt_llm_lacks(tiny_gpt2, tmp_path, capsys):
    """Bad input: scale_attn_by_inverse_layer_idx=true changes attention in a way GPTForCausalLM cannot."""
    model = shutil.copytree(tiny_gpt2, tmp_path / "variant")
    config = json.loads((model / "config.json").read_text())
    config["scale_attn_by_inverse_layer_idx"] = True
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    refused(capsys, out, export(model, out), "scale_attn_by_inverse_layer_idx=true", "TensorRT-LLM cannot build")


def test_parity_option_records_the_comparison(tiny_gpt2, tmp_path, capsys):
    """-o parity=true compares the export with transformers and writes the numbers into the manifest."""
    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, "--tp", 2, "--dtype", "float16", "-o", "parity=true") == 0
    manifest = json.loads((out / "forge-manifest.json").read_text())
    parity = manifest["components"][0]["stages"][0]["notes"]["parity"]
    assert parity["relative"] < parity["tolerance"] == pytest.approx(1e-2)
    assert parity["argmax_agreement"] == 1.0
    code = export(tiny_gpt2, tmp_path / "strict", "--dtype", "float16", "-o", "parity=true",
                  "--parity-tolerance", "1e-9")
    assert code == 1
    assert "differ from transformers" in capsys.readouterr().err.strip().splitlines()[-1]


def test_plugin_modules_import_without_torch():
    """`forge plugins` stays fast: the plugin packages do not import torch or transformers."""
    import subprocess
    import sys

    code = "import sys, forge_gpt, forge_llama; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_uneven_pipeline_split_puts_extra_layer_first(tmp_path):
    """3 layers over 2 stages: stage 0 gets layers 0-1, stage 1 gets layer 2 (TensorRT-LLM's split)."""
    model = make_gpt2(tmp_path / "m", n_layer=3)
    out = tmp_path / "ckpt"
    assert export(model, out, "--pp", 2, "--dtype", "float32") == 0
    layers = [sorted(n for n in load_rank(out / f"rank{r}.safetensors") if n.endswith("input_layernorm.weight"))
              for r in (0, 1)]
    assert layers == [["transformer.layers.0.input_layernorm.weight", "transformer.layers.1.input_layernorm.weight"],
                      ["transformer.layers.0.input_layernorm.weight"]]


@pytest.mark.parametrize("version", ["v0.10.0", "v0.13.0", "v0.16.0"])
def test_uneven_pipeline_split_refused_for_old_backends(version, tmp_path, capsys):
    """Bad input: 3 layers over pp 2 for a release whose loader gives each stage 3 // 2 layers
    (TensorRT-LLM 0.16's own checkpoint loader rejected forge's [0, 1] | [2] split: issue 14)."""
    model = make_gpt2(tmp_path / "m", n_layer=3)
    out = tmp_path / "out"
    refused(capsys, out, export(model, out, "--pp", 2, "--backend-version", version),
            "3 layers cannot be split evenly over --pp 2", "before 1.0")
    assert export(model, out, "--pp", 2, "--backend-version", "v1.0.0") == 0
