"""Families declare their contract as data; the driver refuses whatever a family did not declare."""

from __future__ import annotations

import json

import pytest

import toyplugin
from forge import hookimpl
from forge.cli import main
from forge.components import Family, Option
from forge.testing import use_plugins


def build(model, out, *args):
    return main(["build", "--family", "toy", "--model", str(model), "--out", str(out), *args])


@pytest.mark.parametrize("args, message", [
    (["-o", "slep=1"], "unknown -o slep for family toy; did you mean sleep?"),
    (["-o", "triton_max_batch_size=8"], "valid keys: gain, sleep"),
    (["-o", "gain=2"], "-o gain has no effect on --target python of family toy; it is read by --target echo"),
    (["-o", "sleep=fast"], "-o sleep takes a number, got 'fast'"),
    (["-o", "sleep=-1"], "-o sleep must be at least 0"),
    (["--target", "echo", "-o", "gain=true"], "-o gain takes a number, got True"),
    (["--tp", "2"], "family 'toy' cannot split across ranks for --target python (--tp 2 --pp 1)"),
    (["--pp", "2"], "cannot split across ranks"),
])
def test_undeclared_input_is_refused(toy, toy_model, tmp_path, capsys, args, message):
    """Bad inputs tried: misspelled and foreign -o keys, an option of another target, wrong kinds,
    --tp/--pp on a family without parallelism."""
    out = tmp_path / "out"
    assert build(toy_model, out, *args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--decoupled"], "--decoupled does not apply to family toy"),
    (["--calib-data", "x.txt"], "--calib-data does not apply to family toy"),
    (["--collection", "docs"], "--collection needs --store"),
])
def test_flags_of_other_families_are_refused(toy_model, tmp_path, capsys, args, message):
    """forge build has the flags of every installed family; one the built family does not read is refused."""
    out = tmp_path / "out"
    with use_plugins(("toy", toyplugin), entry_points=True):
        assert build(toy_model, out, *args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def _family_with(*options: Option, name: str = "flagged"):
    class Plugin:
        @hookimpl
        def forge_register_families(self, register):
            register(Family(name=name, kind="encoder", description="declares flags", architectures=("ToyModel",),
                            targets=("python",), default_target="python", components=lambda spec: [],
                            options=options))

    return name, Plugin()


def test_a_declared_flag_is_a_build_flag(toy_model, tmp_path, capsys):
    """A plugin's Option(flag=…) is all it takes: forge build parses the flag and checks it by the declaration."""
    gain = Option("gain", "float", "extra gain", 1.0, exclusive_minimum=0, flag="--gain")
    with use_plugins(_family_with(gain)):
        assert main(["build", "--help"]) == 0
        assert "--gain X" in capsys.readouterr().out
        assert main(["build", "--family", "flagged", "--model", str(toy_model), "--out", str(tmp_path / "o"),
                     "--gain", "0"]) == 2
    assert "--gain must be a positive number, got 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    ((Option("gain", "int", "gain", flag="--gain"),), "declare --gain differently"),
    ((Option("model_dir", "path", "a second model", flag="--model"),),
     "declares --model, which forge build already has"),
])
def test_a_flag_declared_twice_is_a_plugin_error(options, message, toy_model, tmp_path, capsys):
    gain = Option("gain", "float", "extra gain", 1.0, flag="--gain")
    with use_plugins(_family_with(gain), _family_with(*options, name="other")):
        assert main(["build", "--family", "flagged", "--model", str(toy_model), "--out", str(tmp_path / "o")]) == 5
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_plugin_target_builds_with_its_own_option(toy, toy_model, tmp_path):
    out = tmp_path / "repo"
    assert build(toy_model, out, "--target", "echo", "-o", "gain=3") == 0
    scale = json.loads((toy_model / "config.json").read_text())["scale"]
    assert f'string_value: "{scale * 3}"' in (out / "main" / "config.pbtxt").read_text()
    manifest = json.loads((out / "forge-manifest.json").read_text())
    assert manifest["components"][0]["target"] == "echo"


def test_options_command_lists_per_target(toy, capsys):
    assert main(["options", "--family", "toy"]) == 0
    text = capsys.readouterr().out
    assert "sleep" in text and "gain" in text and "[echo]" in text
    assert main(["options", "--family", "toy", "--target", "python", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["sleep"]
    assert rows[0] == {"name": "sleep", "kind": "float", "default": 0, "help": rows[0]["help"],
                       "targets": ["python", "echo"], "choices": [], "flag": None}
    assert main(["options", "--family", "toy", "--target", "vllm"]) == 2
    assert "has no --target vllm" in capsys.readouterr().err
    assert main(["options", "--family", "nope"]) == 2


def test_plugins_json_lists_targets_and_options(toy, capsys):
    assert main(["plugins", "--json"]) == 0
    (toy_info,) = [p for p in json.loads(capsys.readouterr().out) if p["name"] == "toy"]
    (details,) = toy_info["family_details"]
    assert details["targets"] == ["python", "echo"] and details["parallel_targets"] == []
    assert {o["name"] for o in details["options"]} == {"sleep", "gain"}
