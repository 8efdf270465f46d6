"""Which CLIP checkpoints the family accepts, and the one-line errors for those it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
from encoder_fixtures import build, built, manifest_notes, open_clip_weights

from forge.errors import EXIT_USAGE


def error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forge: error:")]
    assert len(lines) == 1
    return lines[0]


def test_dry_run_plans_both_towers_for_tensorrt(hf_clip_model, tmp_path, capsys):
    code = build("--family", "clip", "--model", str(hf_clip_model), "--out", str(tmp_path / "repo"), "--dry-run")
    lines = [line for line in capsys.readouterr().out.splitlines() if "$ trtexec" in line]
    assert code == 0 and len(lines) == 2
    vision, text = lines
    assert "--minShapes=pixel_values:1x3x64x64" in vision and "--maxShapes=pixel_values:8x3x64x64" in vision
    assert "--minShapes=input_ids:1x77" in text and "--optShapes=input_ids:8x77" in text


def test_weights_file_needs_a_model_name(tmp_path, capsys):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert build("--family", "clip", "--model", str(weights), "--out", str(tmp_path / "r"), "--dry-run") == EXIT_USAGE
    assert "-o model_name=NAME" in error_line(capsys)


def test_unknown_open_clip_model_name_lists_known_ones(tmp_path, capsys):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    code = build("--family", "clip", "--model", str(weights), "-o", "model_name=ViT-B32", "--out",
                 str(tmp_path / "r"), "--dry-run")
    line = error_line(capsys)
    assert code == EXIT_USAGE and "no model config 'ViT-B32'" in line and "ViT-B-32" in line


def test_pickle_weights_need_allow_pickle(open_clip_model, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(open_clip_model, model)
    (model / "open_clip_model.safetensors").rename(model / "open_clip_pytorch_model.bin")
    code = build("--family", "clip", "--model", str(model), "--out", str(tmp_path / "r"), "--dry-run")
    line = error_line(capsys)
    assert code == EXIT_USAGE and "pickle" in line and "--allow-pickle" in line


def test_open_clip_directory_without_weights(open_clip_model, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(open_clip_model / "open_clip_config.json", model)
    assert build("--family", "clip", "--model", str(model), "--out", str(tmp_path / "r"), "--dry-run") == EXIT_USAGE
    assert "has no open_clip weights" in error_line(capsys)


def test_open_clip_hf_text_towers_are_refused(open_clip_model, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(open_clip_model, model)
    config = json.loads((model / "open_clip_config.json").read_text())
    config["model_cfg"]["text_cfg"]["hf_tokenizer_name"] = "xlm-roberta-base"
    (model / "open_clip_config.json").write_text(json.dumps(config))
    assert build("--family", "clip", "--model", str(model), "--out", str(tmp_path / "r"), "--dry-run") == EXIT_USAGE
    assert "Hugging Face text towers" in error_line(capsys)


def test_hf_checkpoint_of_another_architecture(hf_clip_model, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(hf_clip_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["SiglipModel"]}))
    assert build("--family", "clip", "--model", str(model), "--out", str(tmp_path / "r"), "--dry-run") == EXIT_USAGE
    assert "'SiglipModel' is not supported by family 'clip'; supported: CLIPModel" in error_line(capsys)


def test_processor_size_must_fit_the_vision_tower(hf_clip_model, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(hf_clip_model, model)
    processor = json.loads((model / "preprocessor_config.json").read_text())
    processor["crop_size"] = {"height": 32, "width": 32}
    (model / "preprocessor_config.json").write_text(json.dumps(processor))
    assert build("--family", "clip", "--model", str(model), "--out", str(tmp_path / "r"), "--dry-run") == EXIT_USAGE
    assert "32x32 images but the vision tower takes 64x64" in error_line(capsys)


def test_bad_normalize_option(hf_clip_model, tmp_path, capsys):
    code = build("--family", "clip", "--model", str(hf_clip_model), "-o", "normalize=maybe", "--out",
                 str(tmp_path / "r"), "--dry-run")
    assert code == EXIT_USAGE and "normalize" in error_line(capsys)


@pytest.mark.heavy
def test_shipped_open_clip_config_with_a_weights_file(tmp_path):
    """open_clip's own ViT-S-32-alt config, random weights as a safetensors file, -o model_name."""
    weights = open_clip_weights("ViT-S-32-alt", tmp_path / "vit-s-32-alt.safetensors")
    repo = built(tmp_path / "repo", "--family", "clip", "--model", str(weights), "-o", "model_name=ViT-S-32-alt",
                 "--target", "python", "--dtype", "float32")
    for component in ("clip_vision", "clip_text"):
        notes = manifest_notes(repo, component, "export")
        assert notes["interface"]["source_format"] == "open_clip" and notes["interface"]["model"] == "ViT-S-32-alt"
        assert notes["parity"]["scaled_diff"] < 1e-4 and notes["parity"]["min_cosine"] > 0.99999
    assert manifest_notes(repo, "clip_text", "export")["tokenizer_parity"]["identical"]
    assert (repo / "clip_vision_encoder" / "1" / "model.onnx").is_file()
