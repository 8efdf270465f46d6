"""Adapters the backend could not serve are refused at build time with one line and exit code 2."""

from __future__ import annotations

import json
import shutil

import pytest

from lora_models import make_adapter, make_gpt2

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return dst


def _pickle_only(src, dst):
    import torch
    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    torch.save(load_file(str(dst / "adapter_model.safetensors")), dst / "adapter_model.bin")
    (dst / "adapter_model.safetensors").unlink()
    return dst


@pytest.fixture(scope="module")
def bad(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-adapters")
    wide = make_gpt2(root / "gpt2-wide", n_embd=32, n_head=4)  # another base: 32 features, not 64
    return {
        "rank mismatch": (_edit_config(models["gpt_A"], root / "rank", r=8),
                          "rank mismatch in transformer.h.0.attn.c_attn: its weights have rank 4 but "
                          "adapter_config.json says 8"),
        "unknown target module": (make_adapter(models["gpt"], root / "lm-head", r=4, alpha=8,
                                               targets=["c_attn", "lm_head"], seed=5),
                                  "unknown target module 'lm_head' for family gpt"),
        "base-model mismatch": (make_adapter(wide, root / "wide", r=4, alpha=8, targets=["c_attn"], seed=6),
                                "base-model mismatch: transformer.h.0.attn.c_attn maps 32 → 96 features, "
                                "the base model's c_attn maps 64 → 192"),
        "other family": (models["llama_A"], "unknown target module 'o_proj' for family gpt (TensorRT-LLM LoRA modules of this family: "
                      "c_attn, c_fc, c_proj)"),
        "pickle only": (_pickle_only(models["gpt_A"], root / "pickle"),
                        "has only adapter_model.bin (pickle), which forge does not load"),
        "DoRA": (_edit_config(models["gpt_A"], root / "dora", use_dora=True), "DoRA (use_dora)"),
        "not an adapter": (models["gpt"], "has no adapter_config.json (not a PEFT adapter)"),
    }


@pytest.mark.parametrize("case", ["rank mismatch", "unknown target module", "base-model mismatch", "other family",
                                  "pickle only", "DoRA", "not an adapter"])
def test_bad_adapter_is_refused_in_one_line(models, bad, case, tmp_path, capsys):
    from forge.cli import main

    adapter, message = bad[case]
    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models["gpt"]), "--target", "python", "--dtype", "float32",
            "--out", str(tmp_path / "repo"), "--lora", f"ok={models['gpt_A']}", "--lora", f"bad={adapter}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "LoRA adapter bad: " in err and message in err, err
    assert not (tmp_path / "repo").exists()  # refused before any stage ran


@pytest.mark.parametrize("value,message", [
    ("noequals", "--lora takes NAME=DIR, got 'noequals'"),
    ("../x=/tmp", "invalid LoRA adapter name '../x'"),
])
def test_bad_lora_flag_values(models, tmp_path, capsys, value, message):
    from forge.cli import main

    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models["gpt"]), "--target", "python", "--dry-run",
            "--out", str(tmp_path / "repo"), "--lora", value]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_lora_is_refused_where_no_model_reads_it(models, tmp_path, capsys):
    from forge.cli import main

    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models["gpt"]), "--target", "hf-pipeline", "--dtype", "float32",
            "--dry-run", "--out", str(tmp_path / "repo"), "--lora", f"A={models['gpt_A']}"]
    assert main(argv) == 2
    assert "--lora" in capsys.readouterr().err


def test_adapter_rank_beyond_the_cache_page_is_refused(models, tmp_path, capsys):
    from forge.cli import main

    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models["gpt"]), "--target", "python", "--dry-run",
            "--out", str(tmp_path / "repo"), "--lora", f"A={models['gpt_A']}", "-o", "lora_cache_max_adapter_size=2"]
    assert main(argv) == 2
    assert "adapter rank 4 exceeds lora_cache_max_adapter_size 2" in capsys.readouterr().err


def test_dash_o_lora_is_the_same_as_the_flag(models, tmp_path, capsys):
    import json

    from forge.cli import main

    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models["gpt"]), "--target", "python", "--dry-run", "--json",
            "--out", str(tmp_path / "repo"), "-o", f"lora=A={models['gpt_A']},B={models['gpt_B']}"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["options"]["lora"] == {
        "A": str(models["gpt_A"]), "B": str(models["gpt_B"])}
