"""Re-make the vendored CRD schemas from upstream CRD files: ``python vendor.py CRD.yaml [...]``.

Each CRD's served version's ``openAPIV3Schema`` is written, with every ``description`` removed (nothing else
changed), to ``<group>_<version>_<kind>.json`` beside this script; PROVENANCE.json says where each came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def vendor(crd_file: Path) -> list[Path]:
    crd = yaml.safe_load(crd_file.read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    written = []
    for version in crd["spec"]["versions"]:
        if not version.get("served", True):
            continue
        schema = without_descriptions(version["schema"]["openAPIV3Schema"])
        out = HERE / f"{group}_{version['name']}_{kind.lower()}.json"
        out.write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
        written.append(out)
    return written


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for path in vendor(Path(arg)):
            print(path.name)
