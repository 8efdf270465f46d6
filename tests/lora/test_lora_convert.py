"""PEFT → TensorRT-LLM LoRA arrays: the documented layout, the repository form, trtllm-build flags, tp splits.

Layout facts (TensorRT-LLM docs/source/advanced/lora.md, examples/hf_lora_convert.py, lora_manager.py):

* ``lora_config`` is [num_lora_modules_layers, 3] int32, one row per (module, layer): module id, layer
  index, adapter size D. Module ids: attn_qkv 0, attn_q 1, attn_k 2, attn_v 3, attn_dense 4, mlp_h_to_4h 5,
  mlp_4h_to_h 6, mlp_gate 7.
* ``lora_weights`` row = flatten(in [D, Hi]) ++ flatten(out [Ho, D]); ``in`` is PEFT's lora_A, ``out`` is
  lora_B multiplied by the scaling alpha / D (alpha / √D with rsLoRA); shorter rows are zero-padded.
* The client form (``model.lora_weights.npy`` / ``model.lora_config.npy``) has a leading batch dimension 1.
* The arrays hold every tensor-parallel rank (the runtime splits): column-parallel modules (qkv, q, k, v,
  h_to_4h, gate) split the ``out`` rows, row-parallel ones (dense, 4h_to_h) the ``in`` columns.
* HF modules: GPT-2 attn.c_attn → attn_qkv, attn.c_proj → attn_dense, mlp.c_fc → mlp_h_to_4h,
  mlp.c_proj → mlp_4h_to_h; Llama q/k/v_proj → attn_q/k/v, o_proj → attn_dense, gate_proj → mlp_h_to_4h,
  up_proj → mlp_gate, down_proj → mlp_4h_to_h.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from forge.llm import lora_format as lora
from forge.publish import MANIFEST

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own


def peft_tensors(adapter_dir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k.removeprefix("base_model.model."): v.astype(np.float32)
            for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}


def family(name):
    from forge_gpt import ADAPTER as GPT
    from forge_llama import ADAPTER as LLAMA

    return {"gpt": GPT, "llama": LLAMA}[name]


def norm_of(base, fam):
    return fam.normalize(json.loads((base / "config.json").read_text()))


def read(models, fam_name, adapter):
    fam = family(fam_name)
    return lora.read(adapter, models[f"{fam_name}_{adapter}"], fam, norm_of(models[fam_name], fam))


def test_gpt_rows_follow_the_documented_layout(models):
    adapter = read(models, "gpt", "A")
    weights, config = adapter.arrays(np.float32)
    # layer-major, modules in declaration order; c_proj matched both attention and MLP projections
    assert config.tolist() == [[0, 0, 4], [4, 0, 4], [6, 0, 4], [0, 1, 4], [4, 1, 4], [6, 1, 4]]
    assert config.dtype == np.int32
    hidden, scale = 64, 8 / 4
    assert weights.shape == (6, max(4 * hidden + 3 * hidden * 4, 4 * 256 + hidden * 4))
    peft = peft_tensors(models["gpt_A"])
    a, b = peft["transformer.h.1.attn.c_attn.lora_A.weight"], peft["transformer.h.1.attn.c_attn.lora_B.weight"]
    assert a.shape == (4, hidden) and b.shape == (3 * hidden, 4)  # in [D, Hi], out [Ho, D]
    row = weights[3]
    np.testing.assert_array_equal(row[:4 * hidden], a.reshape(-1))
    np.testing.assert_array_equal(row[4 * hidden:4 * hidden + 3 * hidden * 4], (b * scale).reshape(-1))
    assert not row[4 * hidden + 3 * hidden * 4:].any()  # zero padding up to the longest row (mlp c_proj)


def test_rslora_and_rank_alpha_patterns_set_each_module_scale(models):
    gpt_b = read(models, "gpt", "B")
    peft = peft_tensors(models["gpt_B"])
    module = gpt_b.modules[0]
    assert (module.target.module, module.rank) == ("mlp_h_to_4h", 4)
    np.testing.assert_array_equal(module.b, peft["transformer.h.0.mlp.c_fc.lora_B.weight"] * (4 / math.sqrt(4)))

    llama_b = read(models, "llama", "B")
    _, config = llama_b.arrays()
    # k_proj (2), gate (5), up (7) at r 2; down_proj (6) at r 4 from rank_pattern
    assert config[:4].tolist() == [[2, 0, 2], [5, 0, 2], [7, 0, 2], [6, 0, 4]]
    peft = peft_tensors(models["llama_B"])
    down = next(m for m in llama_b.modules if m.target.module == "mlp_4h_to_h" and m.layer == 1)
    np.testing.assert_array_equal(down.b, peft["model.layers.1.mlp.down_proj.lora_B.weight"] * (8 / 4))
    up = next(m for m in llama_b.modules if m.target.module == "mlp_gate" and m.layer == 1)
    np.testing.assert_array_equal(up.b, peft["model.layers.1.mlp.up_proj.lora_B.weight"] * (4 / 2))


def test_repository_ships_the_client_form_with_manifest_entries(repos, models):
    manifest = json.loads((repos["llama"] / MANIFEST).read_text())
    notes = [s["notes"]["lora"] for c in manifest["components"] for s in c["stages"] if "lora" in s.get("notes", {})]
    (note,) = notes
    assert note["model"] == "l_tensorrt_llm"
    by_name = {e["name"]: e for e in note["adapters"]}
    assert [by_name[n]["task_id"] for n in ("A", "B")] == [1, 2]
    assert by_name["A"]["rank"] == 4 and by_name["A"]["modules"] == ["attn_q", "attn_v", "attn_dense"]
    assert by_name["B"]["rank"] == 4 and by_name["B"]["module_ids"] == [2, 5, 7, 6]
    assert by_name["A"]["sha256"] == lora.source_hash(models["llama_A"])
    folder = repos["llama"] / "l_tensorrt_llm" / "lora" / "1"
    weights, config = np.load(folder / lora.WEIGHTS_FILE), np.load(folder / lora.CONFIG_FILE)
    assert weights.dtype == np.float16 and config.dtype == np.int32
    assert list(weights.shape) == by_name["A"]["lora_weights"] and weights.shape[0] == 1 == config.shape[0]
    expected, expected_config = read(models, "llama", "A").arrays(np.float16)
    np.testing.assert_array_equal(weights[0], expected)
    np.testing.assert_array_equal(config[0], expected_config)
    # the python model knows which transformers modules take which TensorRT-LLM module ids
    pbtxt = (repos["llama"] / "l_tensorrt_llm" / "config.pbtxt").read_text()
    assert "lora_modules" in pbtxt and "lora_cache_host_memory_bytes" in pbtxt
    assert "lora_prefetch_dir" not in pbtxt  # v0.15.0 has no such parameter: clients send the weights
    assert "lora_prefetch_dir" in (repos["gpt"] / "g_tensorrt_llm" / "config.pbtxt").read_text()


def test_trtllm_build_gets_the_lora_flags(models, tmp_path, capsys):
    from forge.cli import main

    argv = ["build", "--backend-version", ENGINE, "--family", "llama", "--model", str(models["llama"]), "--dry-run", "--json",
            "--lora", f"A={models['llama_A']}", "--lora", f"B={models['llama_B']}", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    manifest = json.loads(capsys.readouterr().out)
    (command,) = [c for comp in manifest["components"] for s in comp["stages"] for c in s["commands"]
                  if c[0] == "trtllm-build"]
    tail = command[command.index("--lora_plugin"):]
    assert tail[:2] == ["--lora_plugin", "float16"]
    assert tail[tail.index("--lora_dir") + 1:tail.index("--lora_dir") + 3] == [str(models["llama_A"]),
                                                                             str(models["llama_B"])]
    modules = tail[tail.index("--lora_target_modules") + 1:tail.index("--max_lora_rank")]
    assert modules == ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"]
    assert tail[tail.index("--max_lora_rank") + 1] == "4"
    pbtxt_param = manifest["spec"]["options"]["lora"]
    assert set(pbtxt_param) == {"A", "B"}


def test_lora_needs_a_backend_with_lora_inputs(models, tmp_path, capsys):
    from forge.cli import main

    base = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models["gpt"]), "--dry-run", "--out", str(tmp_path / "r"),
            "--lora", f"A={models['gpt_A']}"]
    assert main(base + ["--backend-version", "v0.7.1", "--target", "python"]) == 2
    assert "needs tensorrtllm_backend v0.8.0 or newer" in capsys.readouterr().err
    assert main(base + ["--backend-version", "v0.8.0"]) == 2
    assert "needs TensorRT-LLM 0.9 or newer" in capsys.readouterr().err


@pytest.mark.parametrize("fam_name,adapter", [("gpt", "A"), ("llama", "A"), ("llama", "B")])
def test_tp2_split_gives_each_rank_its_slice_of_the_update(models, fam_name, adapter):
    """Per rank, B_r·A_r is exactly the part of the full update B·A that rank's weight shard holds."""
    fam = family(fam_name)
    norm = norm_of(models[fam_name], fam)
    full = read(models, fam_name, adapter)
    tp = 2
    for module in full.modules:
        delta = module.b @ module.a  # [Ho, Hi]
        parts = [lora.shard_module(module, norm, tp, r) for r in range(tp)]
        split = module.target.split
        for r, part in enumerate(parts):
            assert part.rank == module.rank
            mine = part.b @ part.a
            if split == "row":
                n = delta.shape[1] // tp
                np.testing.assert_allclose(mine, delta[:, r * n:(r + 1) * n], rtol=1e-6, atol=1e-6)
            elif split == "column":
                n = delta.shape[0] // tp
                np.testing.assert_allclose(mine, delta[r * n:(r + 1) * n], rtol=1e-6, atol=1e-6)
            elif split == "kv":  # 2 KV heads over 2 ranks: one head each
                d = norm["head_size"]
                np.testing.assert_allclose(mine, delta[r * d:(r + 1) * d], rtol=1e-6, atol=1e-6)
            else:  # fused QKV: this rank's heads of Q, then of K, then of V
                q = norm["q_dim"]
                kv = norm["kv_dim"]
                rows = np.r_[r * q // tp:(r + 1) * q // tp, q + r * kv // tp:q + (r + 1) * kv // tp,
                             q + kv + r * kv // tp:q + kv + (r + 1) * kv // tp]
                np.testing.assert_allclose(mine, delta[rows], rtol=1e-6, atol=1e-6)
    weights, config = lora.shard(full, norm, tp, 1)
    assert config.tolist() == full.arrays()[1].tolist()  # same modules, layers and ranks on every rank
    assert weights.shape[1] < full.arrays()[0].shape[1]  # each rank's rows are shorter


@pytest.mark.parametrize("version,prefetch", [(None, True), ("v0.15.0", False)])
def test_tensorrtllm_target_ships_adapters_and_prefetches_them_where_the_backend_can(models, tmp_path, version,
                                                                                      prefetch):
    """--target tensorrtllm (an engine double stands in for trtllm-build's output): the C++ model's config."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "decoders"))
    import helpers
    from forge.components import Component

    fam = family("gpt")
    out = tmp_path / "repo"
    options = {"lora": {"A": str(models["gpt_A"]), "B": str(models["gpt_B"])}, "lora_cache_host_memory_bytes": 1 << 20}
    ctx = helpers.context(models["gpt"], out, version=version, options=options)
    summary = lora.summary(lora.for_build(fam, ctx.spec, models["gpt"]))
    comp = Component(name="gpt", family="gpt", role="llm", source=models["gpt"], options={"lora": summary})
    built = {m.name: m for m in helpers.repository.emit(fam, comp, helpers.engine_artifact(tmp_path), ctx)}
    llm = built["tensorrt_llm"]
    assert {"lora/1/model.lora_weights.npy", "lora/1/model.lora_config.npy", "lora/2/model.lora_weights.npy",
            "lora/2/model.lora_config.npy"} <= set(llm.files)
    params = {k: v.string_value for k, v in llm.config.parameters.items()}
    assert params["lora_cache_host_memory_bytes"] == str(1 << 20)
    assert params.get("lora_prefetch_dir") == (str((out / "tensorrt_llm" / "lora").resolve()) if prefetch else None)
    assert ctx.record.notes["lora"]["model"] == "tensorrt_llm"
    assert not helpers.write(built, helpers.repository.edges(comp, built, ctx), out)  # forge validate: no problems
