"""setup.cfg lists every package directory (a missing one would vanish from non-editable installs)."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapping = dict(line.split(" = ") for line in cfg["options"]["package_dir"].strip().splitlines())
    found = set()
    for top, rel in mapping.items():
        base = ROOT / rel
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            found.add(".".join((top, *parts)))
    assert found - listed == set(), "add these to [options] packages in setup.cfg"


def test_entry_points_name_every_builtin_family():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    points = dict(line.split(" = ") for line in cfg["options.entry_points"]["forge.plugins"].strip().splitlines())
    assert points == {**{f: f"forge_{f}:plugin" for f in ("gpt", "llama", "clip", "minilm", "llava")},
                      "retrieval": "forge.retrieval:plugin"}
