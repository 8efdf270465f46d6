"""Checkpoint inspection refuses bad input with one line each."""

from __future__ import annotations

import json
import struct

import pytest

from forge.errors import UsageError
from forge.hf import inspect_checkpoint


def _safetensors(path, truncate=0):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + b"\0" * 16
    path.write_bytes(blob[: len(blob) - truncate])


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    _safetensors(d / "model.safetensors")
    return d


def test_good_checkpoint(ckpt):
    info = inspect_checkpoint(ckpt)
    assert info.architecture == "GPT2LMHeadModel"
    assert [p.name for p in info.weight_files] == ["model.safetensors"]


@pytest.mark.parametrize("breakage, message", [
    ("missing_dir", "does not exist"),
    ("empty_dir", "is empty"),
    ("no_config", "config.json is missing"),
    ("bad_json", "is not valid json"),
    ("json_list", "must hold a json object"),
    ("truncated", "is truncated"),
    ("tiny_file", "is truncated"),
    ("pickle_only", "has only pickle weights"),
    ("remote_code", "needs custom code"),
    ("missing_shard", "lists shards that are missing"),
    ("no_weights", "has no weights"),
])
def test_bad_checkpoints(ckpt, tmp_path, breakage, message):
    """Bad inputs tried: each case named in the parameter list."""
    target = ckpt
    if breakage == "missing_dir":
        target = tmp_path / "nowhere"
    elif breakage == "empty_dir":
        target = tmp_path / "empty"
        target.mkdir()
    elif breakage == "no_config":
        (ckpt / "config.json").unlink()
    elif breakage == "bad_json":
        (ckpt / "config.json").write_text("{not json")
    elif breakage == "json_list":
        (ckpt / "config.json").write_text("[]")
    elif breakage == "truncated":
        _safetensors(ckpt / "model.safetensors", truncate=5)
    elif breakage == "tiny_file":
        (ckpt / "model.safetensors").write_bytes(b"abc")
    elif breakage == "pickle_only":
        (ckpt / "model.safetensors").unlink()
        (ckpt / "pytorch_model.bin").write_bytes(b"pickle")
    elif breakage == "remote_code":
        (ckpt / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "m.M"}}))
    elif breakage == "missing_shard":
        (ckpt / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    elif breakage == "no_weights":
        (ckpt / "model.safetensors").unlink()
    with pytest.raises(UsageError, match=message) as info:
        inspect_checkpoint(target)
    assert "\n" not in info.value.one_line()


def test_opt_ins(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"pickle")
    assert inspect_checkpoint(ckpt, allow_pickle=True).weight_format == "pickle"
    (ckpt / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "m.M"}}))
    assert inspect_checkpoint(ckpt, allow_pickle=True, trust_remote_code=True).config["auto_map"]
