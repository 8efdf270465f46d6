"""forge plugins: list every plugin found, with its families and hooks."""

from __future__ import annotations

import argparse
from dataclasses import asdict

HELP = "list installed plugins, their families and the hooks they implement"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print as json")


def run(args: argparse.Namespace) -> int:
    from ..contract import describe
    from ..registry import registry
    from ..ui import emit_json

    reg = registry()
    if args.json:
        emit_json([{**asdict(info), "family_details": [
            {"name": f, "kind": reg.families[f].kind, "architectures": list(reg.families[f].architectures),
             "targets": list(reg.families[f].targets), "default_target": reg.families[f].default_target,
             "quants": list(reg.families[f].quants), "dtypes": list(reg.families[f].dtypes),
             "parallel_targets": list(reg.families[f].parallel_targets),
             "options": describe(reg.families[f])} for f in info.families]}
            for info in reg.infos.values()])
        return 0
    if not reg.infos:
        print("no plugins installed")
    for info in reg.infos.values():
        print(f"{info.name} {info.version} ({info.distribution})")
        for name in info.families:
            family = reg.families[name]
            print(f"  family {name}: {family.description}; targets {', '.join(family.targets)}")
        print(f"  hooks: {', '.join(info.hooks)}")
    return 0
