"""Plugin discovery: entry points, typo'd hooks, failing imports, blocking, `forge plugins`."""

from __future__ import annotations

import json
import types

import pytest

from forge import hookimpl
from forge.cli import main
from forge.errors import PluginError
from forge.plugins import load_registry, registry
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
