"""Building llava: the plugin's contract, what it refuses, the vision export's parity, the tensorrtllm repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import BUILD
from tiny_llava import IMAGE_SIZE, png, visual_tokens

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

HOOKS = {"forge_register_families", "forge_export", "forge_quantize", "forge_compile", "forge_emit_config",
         "forge_ensemble_edges"}
TRTLLM_BUILD = """#!/bin/sh
# stand-in for trtllm-build (this machine has no TensorRT-LLM): writes the engine directory's shape
out=""; prev=""
for a in "$@"; do [ "$prev" = "--output_dir" ] && out="$a"; prev="$a"; done
mkdir -p "$out" && echo '{"version": "stand-in", "pretrained_config": {"dtype": "float16", "vocab_size": 402}}' > "$out/config.json"
echo stand-in > "$out/rank0.engine"
"""
TRTEXEC = """#!/bin/sh
# stand-in for trtexec: writes the file named by --saveEngine
for a in "$@"; do case $a in --saveEngine=*) echo plan > "${a#--saveEngine=}";; esac; done
"""


def forge(*argv: str) -> int:
    from forge.cli import main

    return main(list(argv))


def manifest(repo: Path) -> dict:
    return json.loads((repo / "forge-manifest.json").read_text())


def stage(repo: Path, component: str, name: str) -> dict:
    entry = next(c for c in manifest(repo)["components"] if c["name"] == component)
    return next(s for s in entry["stages"] if s["stage"] == name)


def test_plugins_lists_llava_with_every_hook(capsys):
    assert forge("plugins", "--json") == 0
    llava = next(p for p in json.loads(capsys.readouterr().out) if p["name"] == "llava")
    assert set(llava["hooks"]) == HOOKS
    family = llava["family_details"][0]
    assert family["architectures"] == ["LlavaForConditionalGeneration"]
    assert family["targets"] == ["python", "tensorrtllm"]


def test_python_repository_is_composed_of_llama_and_vision_components(llava_repo):
    """The language model is a llama component (the llama plugin's stages); the vision one is llava's."""
    components = {c["name"]: c for c in manifest(llava_repo)["components"]}
    assert components["llava_language_model"]["family"] == "llama"
    assert components["llava_vision"]["family"] == "llava"
    assert components["llava_language_model"]["artifact"]["kind"] == "trtllm-checkpoint"  # the llama export ran
    parity = stage(llava_repo, "llava_vision", "export")["notes"]
    assert parity["parity"]["scaled_diff"] <= parity["parity"]["tolerance"]
    assert parity["parity_transformers"]["scaled_diff"] <= parity["parity_transformers"]["tolerance"] == 1e-4
    assert "get_image_features" in parity["parity_transformers"]["against"]
    assert forge("validate", str(llava_repo)) == 0


def test_new_key_layout_full_strategy_matches_get_image_features(tiny_llava_new_keys, tmp_path):
    """``model.language_model.*`` keys, strategy "full" (CLS kept), layer -1: the served graph = transformers."""
    import onnxruntime as ort
    import torch
    from PIL import Image
    import io
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

    from forge.tritonconfig import read

    out = tmp_path / "repo"
    assert forge("build", "--backend-version", ENGINE, "--family", "llava", "--model", str(tiny_llava_new_keys), "--out", str(out),
                 "--target", "python", "--dtype", "float32", "--max-input-len", "64", "--max-seq-len", "128") == 0
    config = read(out / "multimodal_encoders")
    assert config.parameters["visual_tokens"].string_value == "17"
    assert read(out / "preprocessing").parameters["image_token_id"].string_value
    notes = stage(out, "llava_vision", "export")["notes"]
    assert notes["interface"]["key_layout"] == "model.language_model.*"
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_new_keys, dtype=torch.float32).eval()
    pixels = CLIPImageProcessor.from_pretrained(tiny_llava_new_keys)(
        [Image.open(io.BytesIO(png(seed))) for seed in (7, 8)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = torch.stack(list(model.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=-1, vision_feature_select_strategy="full").pooler_output))
    session = ort.InferenceSession(str(out / "multimodal_encoders" / "1" / "onnx" / "model.onnx"))
    got = session.run(None, {"pixel_values": pixels.numpy()})[0]
    assert got.shape == (2, visual_tokens(model.config), model.config.text_config.hidden_size)
    assert np.abs(got - expected.numpy()).max() <= 1e-4 * max(1.0, float(expected.abs().max()))


@pytest.fixture
def stand_in_tools(tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, text in (("trtllm-build", TRTLLM_BUILD), ("trtexec", TRTEXEC)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{Path(__import__('sys').executable).parent}:/usr/bin:/bin")
    return tools


@pytest.mark.parametrize("version", ["v0.13.0", None])
def test_tensorrtllm_repository_validates_with_prompt_table_wiring(tiny_llava, tmp_path, stand_in_tools, version):
    from forge.tritonconfig import read

    out = tmp_path / "repo"
    argv = ["build", "--backend-version", ENGINE, "--family", "llava", "--model", str(tiny_llava), "--out", str(out), "--target", "tensorrtllm",
            "--max-batch-size", "4", "--max-input-len", "64", "--max-seq-len", "128"]
    assert forge(*argv, *(["--backend-version", version] if version else [])) == 0
    assert forge("validate", str(out)) == 0
    rows = visual_tokens(__import__("transformers").LlavaConfig.from_pretrained(tiny_llava))
    (build,) = stage(out, "llava_language_model", "compile")["commands"]
    assert build[build.index("--max_multimodal_len") + 1] == str(4 * rows)
    (trtexec,) = stage(out, "llava_vision", "compile")["commands"]
    shape = f"3x{IMAGE_SIZE}x{IMAGE_SIZE}"
    assert f"--minShapes=pixel_values:1x{shape}" in trtexec and f"--maxShapes=pixel_values:4x{shape}" in trtexec
    assert "--fp16" in trtexec
    encoders = read(out / "multimodal_encoders")
    assert encoders.parameters["runtime"].string_value == "tensorrt"
    assert (out / "multimodal_encoders" / "1" / "model.plan").is_file()
    llm = read(out / "tensorrt_llm")
    assert llm.backend == "tensorrtllm"
    table = next(t for t in llm.input if t.name == "prompt_embedding_table")
    assert next(t for t in encoders.output if t.name == "OUT_PROMPT_EMBEDDING_TABLE").data_type == table.data_type
    steps = {s.model_name: s for s in read(out / "ensemble").ensemble_scheduling.step}
    produced = steps["multimodal_encoders"].output_map
    assert steps["tensorrt_llm"].input_map["prompt_embedding_table"] == produced["OUT_PROMPT_EMBEDDING_TABLE"]
    assert steps["tensorrt_llm"].input_map["prompt_vocab_size"] == produced["OUT_PROMPT_VOCAB_SIZE"]
    assert steps["preprocessing"].input_map["PROMPT_VOCAB_SIZE"] == produced["OUT_PROMPT_VOCAB_SIZE"]
    # KV-cache reuse is keyed by the image: the encoder's hash reaches tensorrt_llm's prompt_table_extra_ids
    assert steps["preprocessing"].input_map["PROMPT_TABLE_EXTRA_ID"] == produced["OUT_PROMPT_TABLE_EXTRA_ID"]
    extra_ids = steps["preprocessing"].output_map["OUT_PROMPT_TABLE_EXTRA_IDS"]
    assert steps["tensorrt_llm"].input_map["prompt_table_extra_ids"] == extra_ids
    inputs = {t.name: t for t in read(out / "ensemble").input}
    assert inputs["image"].optional
    assert not {"prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_id"} & set(inputs)


def _edited(model: Path, tmp_path: Path, **changes) -> Path:
    """A copy of ``model`` whose config.json has ``changes`` (weights linked, not copied)."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for path in model.iterdir():
        (copy / path.name).symlink_to(path)
    (copy / "config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["LlavaNextForConditionalGeneration"]}, "is not supported by family 'llava'"),
    ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy 'cls' is not supported"),
    ({"vision_feature_layer": [-2, -5]}, "lists of layers are not"),
    ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu'"),
    ({"text_config": {"model_type": "qwen2"}}, "the language model is 'qwen2'"),
    ({"vision_config": {"model_type": "siglip_vision_model"}}, "vision tower 'siglip_vision_model'"),
    ({"image_token_index": 99999}, "outside the language model's vocabulary"),
])
def test_refused_checkpoints_fail_in_one_line(tiny_llava, tmp_path, capsys, changes, message):
    model = _edited(tiny_llava, tmp_path, **changes)
    code = forge("build", "--backend-version", ENGINE, "--family", "llava", "--model", str(model), "--out", str(tmp_path / "repo"),
                 "--target", "python", "--dtype", "float32", "--max-input-len", "64", "--max-seq-len", "128")
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("extra, message", [
    (["--backend-version", "v0.12.0"], "follow tensorrtllm_backend v0.13.0 or newer"),
    (["-o", "bls=true"], "does not route images"),
    (["--max-input-len", "16", "--max-seq-len", "128"], "one image alone takes 16 tokens"),
    (["-o", "vision_threads=-1"], "vision_threads"),
])
def test_refused_options_fail_in_one_line(tiny_llava, tmp_path, capsys, extra, message):
    argv = ["build", "--backend-version", ENGINE, "--family", "llava", "--model", str(tiny_llava), "--out", str(tmp_path / "repo"),
            "--target", "python", "--dtype", "float32"]
    if "--max-input-len" not in extra:
        argv += ["--max-input-len", "64", "--max-seq-len", "128"]
    code = forge(*argv, *extra)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "Traceback" not in err, err


def test_without_a_backend_version_llava_builds_for_the_newest_release_of_its_layout(tiny_llava, tmp_path, capsys):
    """The newest release writes the LLM-API layout, which llava does not build yet: with no --backend-version the
    build takes the newest engine release and says so; naming the LLM-API release is refused in one line."""
    out = tmp_path / "repo"
    assert forge("build", "--family", "llava", "--model", str(tiny_llava), "--out", str(out), *BUILD) == 0
    err = capsys.readouterr().err
    assert f"llava: built for {ENGINE}, the newest release whose layout it supports" in err
    manifest = json.loads((out / "forge-manifest.json").read_text())
    assert manifest["spec"]["backend_version"] == ENGINE
    assert {"ensemble", "multimodal_encoders", "tensorrt_llm"} <= {p.name for p in out.iterdir() if p.is_dir()}
    assert forge("build", "--family", "llava", "--model", str(tiny_llava), "--out", str(tmp_path / "r2"),
                 "--target", "python", "--backend-version", "latest") == 2
    assert "is not built by forge yet" in capsys.readouterr().err
