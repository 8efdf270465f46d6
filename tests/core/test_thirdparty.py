"""A third-party plugin package, pip-installed from its own setup.cfg, is used by `forge build`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent

SETUP_CFG = """
[metadata]
name = forge-echo-plugin
version = 0.3.1

[options]
py_modules = forge_echo

[options.entry_points]
forge.plugins =
    echo = forge_echo
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("forge-echo-plugin")
    (src / "setup.cfg").write_text(SETUP_CFG)
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\n'
                                        'build-backend = "setuptools.build_meta"\n')
    # The plugin is the toy plugin's code under another family name: a real module in a real package.
    code = (HERE / "toyplugin.py").read_text().replace('"toy"', '"echo"').replace("toy family", "echo family")
    (src / "forge_echo.py").write_text(code)
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True)
    return target


def _forge(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "forge", *args], env=env, cwd=cwd, capture_output=True, text=True)


def test_installed_plugin_is_listed_and_builds(installed, tmp_path):
    listed = _forge(installed, "plugins", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    (echo,) = [p for p in json.loads(listed.stdout) if p["name"] == "echo"]
    assert echo["distribution"] == "forge-echo-plugin" and echo["version"] == "0.3.1"
    assert echo["families"] == ["echo"]

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["ToyModel"], "scale": 2.0}))
    built = _forge(installed, "build", "--family", "echo", "--model", str(model), "--out", str(tmp_path / "repo"),
                   "--target", "echo", "-o", "gain=2",
                   cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    manifest = json.loads((tmp_path / "repo" / "forge-manifest.json").read_text())
    assert manifest["plugins"] == {"echo": "0.3.1"}
    assert manifest["components"][0]["family"] == "echo"
    # a target no built-in family knows, added by the package alone, with its own -o option
    assert manifest["components"][0]["target"] == "echo"
    assert 'string_value: "4.0"' in (tmp_path / "repo" / "main" / "config.pbtxt").read_text()


def test_broken_installed_plugin_names_its_distribution(installed, tmp_path):
    broken = tmp_path / "site"
    import shutil

    shutil.copytree(installed, broken)
    (broken / "forge_echo.py").write_text("raise RuntimeError('echo is broken')\n")
    result = _forge(broken, "plugins", cwd=tmp_path)
    assert result.returncode == 5
    assert "'echo' from distribution 'forge-echo-plugin'" in result.stderr
    assert "RuntimeError: echo is broken" in result.stderr
    assert "Traceback" not in result.stderr
