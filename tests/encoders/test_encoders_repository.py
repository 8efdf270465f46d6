"""Several encoder families in one repository, and the TensorRT plan of the build."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from encoder_fixtures import build, built, cosine, infer, manifest_notes, serving

from forge.encoder.samples import synthetic_image


def test_multi_family_dry_run_names_components(hf_clip_model, minilm_model, tmp_path, capsys):
    code = build("--family", "clip", "--family", "minilm", "--model", f"clip={hf_clip_model}",
                 "--model", f"minilm={minilm_model}", "--out", str(tmp_path / "repo"), "--dry-run")
    out = capsys.readouterr().out
    assert code == 0
    for component in ("clip_vision", "clip_text", "minilm"):
        assert f"  {component} (family" in out
    assert out.count("$ trtexec") == 3


@pytest.mark.heavy
def test_clip_and_minilm_in_one_repository(hf_clip_model, minilm_model, tmp_path):
    """One build: prefixed model names, one ensemble per pipeline, validated and served as a whole."""
    from sentence_transformers import SentenceTransformer

    from forge.cli import main
    from forge.tritonconfig import read

    repo = built(tmp_path / "repo", "--family", "clip,minilm", "--model", f"clip={hf_clip_model}",
                 "--model", f"minilm={minilm_model}", "--target", "python", "--dtype", "float32")
    models = sorted(p.name for p in repo.iterdir() if p.is_dir())
    assert models == ["clip_image", "clip_text", "clip_text_encoder", "clip_text_tokenizer", "clip_vision_encoder",
                      "clip_vision_preprocessing", "minilm", "minilm_encoder", "minilm_tokenizer"]
    assert read(repo / "minilm").platform == "ensemble"  # not "ensemble": several pipelines share the repository
    assert main(["validate", str(repo)]) == 0
    texts = ["a photo of a dog", ""]
    expected = SentenceTransformer(str(minilm_model), device="cpu").encode(texts, normalize_embeddings=True)
    with serving(repo) as (_, client):
        assert cosine(infer(client, "minilm", "text_input", texts), expected).min() >= 0.999
        assert infer(client, "clip_text", "text_input", texts).shape == (2, 24)
        assert infer(client, "clip_image", "image", [synthetic_image(80, 60)]).shape == (1, 24)


@pytest.mark.heavy
def test_name_prefix_applies_to_models_and_ensembles(minilm_model, tmp_path):
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "onnxruntime",
                 "--dtype", "float32", "--name-prefix", "search_")
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["search_ensemble", "search_minilm_encoder",
                                                                     "search_minilm_tokenizer"]


@pytest.mark.heavy
def test_tensorrt_int8_writes_a_calibration_cache(hf_clip_model, tmp_path, monkeypatch, capsys):
    """--target tensorrt --quant int8: TensorRT's calibration cache is built, then trtexec is needed."""
    from forge.cache import StageCache

    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    code = build("--family", "clip", "--model", str(hf_clip_model), "--quant", "int8", "-o", "trt_version=8.6.1",
                 "--out", str(tmp_path / "repo"))
    error = capsys.readouterr().err
    assert code == 3 and "--int8 --calib=" in error
    calib = error.split("--calib=")[1].split()[0]
    lines = open(calib).read().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    scales = dict(line.split(": ") for line in lines[1:])
    assert "pixel_values" in scales and len(scales) > 20
    for value in scales.values():
        scale = struct.unpack(">f", bytes.fromhex(value))[0]
        assert np.isfinite(scale) and scale > 0
    assert str(StageCache().root) in calib


@pytest.mark.heavy
def test_tensorrt_build_with_a_trtexec_on_path(minilm_model, tmp_path, monkeypatch):
    """With trtexec present the plan becomes a tensorrt_plan model; the command is in the manifest.

    The stand-in trtexec writes the file named by --saveEngine (this machine has no TensorRT).
    """
    from forge.cli import main
    from forge.tritonconfig import read

    tools = tmp_path / "bin"
    tools.mkdir()
    fake = tools / "trtexec"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do case $a in --saveEngine=*) echo plan > \"${a#--saveEngine=}\";; "
                    "esac; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--instances", "2")
    encoder = read(repo / "minilm_encoder")
    assert encoder.platform == "tensorrt_plan" and (repo / "minilm_encoder" / "1" / "model.plan").is_file()
    assert encoder.instance_group[0].kind == encoder.instance_group[0].KIND_GPU
    assert encoder.instance_group[0].count == 2
    assert read(repo / "minilm_tokenizer").parameters["padding"].string_value == "max_length"
    notes = manifest_notes(repo, "minilm", "compile")
    assert notes["tensorrt"]["profile"]["opt"] == "input_ids:8x256,attention_mask:8x256"
    assert main(["validate", str(repo)]) == 0
