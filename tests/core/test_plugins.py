"""Plugin discovery: entry points, typo'd hooks, failing imports, blocking, `forge plugins`."""

from __future__ import annotations

import json
import subprocess
import sys
import types
import zipfile

import pytest

from forge import hookimpl, registry as plugins
from forge.cli import main
from forge.errors import PluginError
from forge.registry import load_registry, registry
from forge.testing import FakeEntryPoint, fake_entry_points, registry_with


def test_in_memory_plugin_registers_its_family(toy):
    reg = registry()
    assert reg.family("toy").plugin == "toy"
    assert reg.infos["toy"].families == ["toy"]
    assert "forge_export" in reg.infos["toy"].hooks


def test_unknown_family_lists_known_ones(toy, toy_model, tmp_path, capsys):
    code = main(["build", "--family", "nope", "--model", str(toy_model), "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown family 'nope'; known families: toy" in err
    assert len(err.strip().splitlines()) == 1


def test_misspelled_hook_is_rejected():
    typo = types.SimpleNamespace(forge_exprot=hookimpl(lambda component, ctx: None))
    with pytest.raises(PluginError, match="unknown hook"):
        registry_with(("typo", typo))


def test_failing_entry_point_names_distribution_and_entry_point(capsys):
    broken = FakeEntryPoint("broken", ImportError("No module named 'forge_broken'"),
                            distribution="forge-broken-plugin")
    with fake_entry_points(broken, keep_installed=False):
        assert main(["plugins"]) == 5
    err = capsys.readouterr().err
    assert "'broken' from distribution 'forge-broken-plugin'" in err
    assert "FORGE_DISABLE_PLUGINS=broken" in err


def test_disable_env_blocks_a_plugin(monkeypatch):
    broken = FakeEntryPoint("broken", ImportError("boom"))
    monkeypatch.setenv("FORGE_DISABLE_PLUGINS", "broken")
    with fake_entry_points(broken, keep_installed=False):
        reg = load_registry()
    assert "broken" not in reg.infos


def test_entry_point_plugin_is_loaded_like_a_builtin():
    import toyplugin

    with fake_entry_points(FakeEntryPoint("toy", toyplugin, "forge-toy", "1.2.3"), keep_installed=False):
        reg = load_registry()
    assert reg.infos["toy"].distribution == "forge-toy"
    assert reg.plugin_version("toy") == "1.2.3"


def test_two_plugins_claiming_one_family_is_an_error():
    import toyplugin

    clone = types.SimpleNamespace(forge_register_families=toyplugin.forge_register_families)
    with pytest.raises(PluginError, match="registered by both"):
        registry_with(("toy", toyplugin), ("clone", clone))


def test_plugins_json_lists_families_and_hooks(toy, capsys):
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (toy_info,) = [p for p in data if p["name"] == "toy"]
    assert toy_info["families"] == ["toy"]
    assert toy_info["family_details"][0]["targets"] == ["python", "echo"]
    assert set(toy_info["hooks"]) >= {"forge_export", "forge_emit_config", "forge_ensemble_edges"}


def _dist(root, directory: str, entry_points: str | None, metadata: str = "", filename: str = "METADATA"):
    info = root / directory
    info.mkdir(parents=True)
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)
    (info / filename).write_text(metadata)


def test_entry_point_scan_agrees_with_importlib_metadata(tmp_path, monkeypatch):
    """The scan that spares every command importlib.metadata finds what importlib.metadata finds:
    dist-info and egg-info, the first distribution of a (normalized) name across the path, other
    groups and comments ignored, a missing path entry skipped."""
    first, second = tmp_path / "first", tmp_path / "second"
    _dist(first, "Forge_Alpha-1.0.dist-info", "# comment\n[console_scripts]\nalpha = alpha:main\n\n"
          "[forge.plugins]\nalpha = forge_alpha:plugin\n  beta=forge_alpha.sub:obj.attr [extra]\n",
          "Metadata-Version: 2.1\nName: Forge_Alpha\nVersion: 1.0\n\nName: not this\n")
    _dist(first, "forge.gamma-2.0b1.egg-info", "[forge.plugins]\ngamma = forge_gamma\n",
          "Metadata-Version: 1.1\nName: forge.gamma\nVersion: 2.0b1\n", filename="PKG-INFO")
    _dist(first, "unrelated-3.dist-info", "[console_scripts]\nu = u:main\n", "Name: unrelated\nVersion: 3\n")
    _dist(first, "no_points-1.dist-info", None, "Name: no-points\nVersion: 1\n")
    _dist(second, "forge_alpha-9.9.dist-info", "[forge.plugins]\nshadowed = forge_alpha:other\n",
          "Name: forge-alpha\nVersion: 9.9\n")  # same project as first/Forge_Alpha: importlib skips it
    _dist(second, "forge_delta-0.1.dist-info", "[forge.plugins]\ndelta = forge_delta:plugin\n",
          "Name: forge-delta\nVersion: 0.1\n")
    monkeypatch.setattr(sys, "path", [str(first), str(tmp_path / "missing"), str(second)])

    scanned = sorted(plugins._scan(sys.path), key=lambda ep: ep.name)
    assert scanned == sorted(plugins._from_importlib_metadata(), key=lambda ep: ep.name)
    assert [(ep.name, ep.value, ep.distribution, ep.version) for ep in scanned] == [
        ("alpha", "forge_alpha:plugin", "Forge_Alpha", "1.0"),
        ("beta", "forge_alpha.sub:obj.attr [extra]", "Forge_Alpha", "1.0"),
        ("delta", "forge_delta:plugin", "forge-delta", "0.1"),
        ("gamma", "forge_gamma", "forge.gamma", "2.0b1")]


def test_a_zipped_plugin_is_found_through_importlib_metadata(tmp_path, monkeypatch):
    """A zip archive on the path is not scanned by hand: importlib.metadata reads it, and the plugin loads
    from the archive (zipimport)."""
    archive = tmp_path / "plugins.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("forge_zipped.py", "MARK = 'zipped'\n")
        z.writestr("forge_zipped-1.4.dist-info/METADATA", "Metadata-Version: 2.1\nName: forge-zipped\nVersion: 1.4\n")
        z.writestr("forge_zipped-1.4.dist-info/entry_points.txt", "[forge.plugins]\nzipped = forge_zipped\n")
    monkeypatch.setattr(sys, "path", [str(archive), *sys.path])
    monkeypatch.delitem(sys.modules, "forge_zipped", raising=False)
    assert plugins._scan(sys.path) is None
    (zipped,) = [ep for ep in plugins.iter_entry_points() if ep.name == "zipped"]
    assert (zipped.distribution, zipped.version) == ("forge-zipped", "1.4")
    assert zipped.load().MARK == "zipped"


def test_entry_point_load_follows_the_attribute_path():
    ep = plugins.EntryPoint("x", "forge.errors:PluginError.__name__ [extra]")
    assert ep.load() == "PluginError"
    assert plugins.EntryPoint("y", "forge.errors").load() is sys.modules["forge.errors"]


def test_a_forge_plugins_line_without_equals_is_refused():
    with pytest.raises(PluginError, match=r"entry point line 'broken' in group forge.plugins has no '='"):
        list(plugins._group("[forge.plugins]\nbroken\n", plugins.ENTRY_POINT_GROUP))
    assert list(plugins._group("[other]\nbroken\n", plugins.ENTRY_POINT_GROUP)) == []


def test_decoder_options_are_made_when_first_read(tmp_path):
    """Loading the plugins does not fold tensorrtllm_backend's releases into the decoder families' options
    (~20 ms of every command, though only build/options/validate read them); reading them does, and they are
    the same options as the ones made directly."""
    code = ("import sys\nfrom forge.registry import load_registry\nfamilies = load_registry().families\n"
            "assert 'forge.profiles' not in sys.modules\n"
            "from forge.llm.decoder_options import decoder_options\n"
            "from forge.llm.plugin import family_options\n"
            "from forge_llava import VISION_OPTIONS\n"
            "assert tuple(families['llama'].options) == family_options()\n"
            "assert tuple(families['llava'].options) == decoder_options() + VISION_OPTIONS\n"
            "assert families['gpt'].option('instances').kind == 'int'\n"
            "assert families['llama'].options == families['gpt'].options and len(families['llama'].options) > 10\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
