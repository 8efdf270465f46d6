"""The build driver: stage order, caching, manifest, atomic output, locking, dry run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge import publish as repository
from forge.cli import main
from forge.checks import validate_repository

HERE = Path(__file__).parent


def build(toy_model, out, *extra):
    return main(["build", "--family", "toy", "--model", str(toy_model), "--out", str(out), *extra])


def test_build_writes_complete_repository(toy, toy_model, tmp_path):
    out = tmp_path / "repo"
    assert build(toy_model, out) == 0
    assert toy.calls == ["export", "compile", "emit_config"]
    assert sorted(p.name for p in out.iterdir()) == ["ensemble", "forge-manifest.json", "main", "pre"]
    assert (out / "ensemble" / "1").is_dir()
    assert validate_repository(out) == []
    manifest = json.loads((out / "forge-manifest.json").read_text())
    assert manifest["models"] == ["ensemble", "main", "pre"]
    stages = manifest["components"][0]["stages"]
    assert [s["stage"] for s in stages] == ["export", "quantize", "compile", "emit_config"]
    assert stages[0]["notes"] == {"parity": {"max_abs_diff": 0.0}}
    assert all(len(s["key"]) == 64 for s in stages)


def test_second_identical_build_does_no_work(toy, toy_model, tmp_path, capsys):
    out = tmp_path / "repo"
    assert build(toy_model, out) == 0
    before = (out / "forge-manifest.json").stat().st_mtime_ns
    toy.calls.clear()
    assert build(toy_model, out) == 0
    assert toy.calls == []
    assert (out / "forge-manifest.json").stat().st_mtime_ns == before
    assert "up to date" in capsys.readouterr().out


def test_changed_option_rebuilds_and_cached_stages_are_reused(toy, toy_model, tmp_path):
    out = tmp_path / "repo"
    assert build(toy_model, out) == 0
    toy.calls.clear()
    assert build(toy_model, tmp_path / "other") == 0  # same inputs, new output: stages come from the cache
    assert toy.calls == ["emit_config"]
    toy.calls.clear()
    (toy_model / "config.json").write_text(json.dumps({"architectures": ["ToyModel"], "scale": 5.0}))
    assert build(toy_model, out) == 0
    assert toy.calls == ["export", "compile", "emit_config"]
    assert 'string_value: "5.0"' in (out / "main" / "config.pbtxt").read_text()


def test_name_prefix_prefixes_models_and_ensemble(toy, toy_model, tmp_path):
    out = tmp_path / "repo"
    assert build(toy_model, out, "--name-prefix", "a_") == 0
    assert {"a_pre", "a_main", "a_ensemble"} <= {p.name for p in out.iterdir()}


def test_dry_run_writes_nothing(toy, toy_model, tmp_path, capsys):
    out = tmp_path / "repo"
    assert build(toy_model, out, "--dry-run") == 0
    assert not out.exists()
    assert "plan for" in capsys.readouterr().out


def test_lock_stops_a_second_writer(toy, toy_model, tmp_path, cache, capsys):
    from filelock import FileLock
    import hashlib

    out = tmp_path / "repo"
    key = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:24]
    (cache / "locks").mkdir(parents=True)
    with FileLock(str(cache / "locks" / f"{key}.lock")):
        assert build(toy_model, out) == 2
    assert "another forge build is writing" in capsys.readouterr().err
    assert not out.exists()


def test_refuses_to_overwrite_a_foreign_directory(toy, toy_model, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert build(toy_model, out) == 2
    assert "forge did not write" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "keep me"


KILLER = """
import sys
sys.path.insert(0, {here!r})
import toyplugin
from forge.testing import use_plugins
from forge.cli import main
with use_plugins(("toy", toyplugin)):
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("delay", [0.3, 1.2, 2.2, 3.2])
def test_sigkill_at_any_point_leaves_no_partial_output(toy_model, tmp_path, delay):
    """Bad input tried: a build killed with SIGKILL during export, emit_config and the write."""
    out = tmp_path / "repo"
    script = tmp_path / "run.py"
    script.write_text(KILLER.format(here=str(HERE)))
    args = [sys.executable, str(script), "build", "--family", "toy", "--model", str(toy_model),
            "--out", str(out), "-o", "sleep=1"]
    proc = subprocess.Popen(args, env={**os.environ}, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if out.exists():  # only ever the finished repository
        assert (out / repository.MANIFEST).is_file()
        assert validate_repository(out) == []
    # the next build cleans up whatever the killed one left and succeeds
    assert subprocess.run(args[:-2], env={**os.environ}).returncode == 0
    assert validate_repository(out) == []
    leftovers = [p.name for p in tmp_path.iterdir() if "forge-staging" in p.name]
    assert leftovers == []


def test_export_writes_only_the_exported_artifact(toy, toy_model, tmp_path):
    out = tmp_path / "exported"
    assert main(["export", "--family", "toy", "--model", str(toy_model), "--out", str(out)]) == 0
    assert toy.calls == ["export"]
    assert json.loads((out / "exported.json").read_text()) == {"scale": 3.0}
    assert (out / repository.MANIFEST).is_file()


def test_doctor_reports_toolchain(toy, capsys):
    assert main(["doctor", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["forge"]["version"]
    assert rows["trtllm-build"]["enables"].startswith("--target tensorrtllm")
    assert "tritonserver (nvidia-pytriton)" in rows
    kernels = rows["forge CPU kernels"]  # this machine has cc; without AVX-512 the row says so
    assert kernels["version"].startswith(("loaded (", "not used: this CPU has no AVX-512")), kernels
    assert "SDPA" in kernels["enables"]


def test_dry_run_plan_names_the_cache_paths_of_a_real_build(toy, toy_model, tmp_path, cache):
    """The plan's paths are where a real build puts its artifacts; the dry run leaves no cache entry."""
    from forge.driver import Driver
    from forge.registry import registry
    from forge.spec import BuildSpec

    spec = BuildSpec(families=["toy"], model=toy_model, out=tmp_path / "repo", dry_run=True)
    planned = Driver(registry()).build(spec).plans[0].artifact.path
    assert not planned.exists() and not any((cache / "stages").iterdir())
    spec.dry_run = False
    built = Driver(registry()).build(spec).plans[0].artifact.path
    assert built == planned and built.is_dir()
