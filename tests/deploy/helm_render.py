"""Render forge's Helm chart without helm, for the few template forms forge writes (forge.k8s.helm):
``{{ .Values.X }}``, ``{{ .Values.X | quote }}``, ``{{- toYaml .Values.X | nindent N }}`` and one
``{{- if .Values.X }}`` … ``{{- end }}`` around a whole file. Anything else is an error here, so a template that
grows another form fails this test until helm itself checks it. Where ``helm`` is installed, the tests run
``helm template`` too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

_IF = re.compile(r"\{\{- if (\.Values\.[A-Za-z.]+) \}\}\n")
_END = re.compile(r"\{\{- end \}\}\n?$")
_TOYAML = re.compile(r"\n\{\{- toYaml (\.Values\.[A-Za-z.]+) \| nindent (\d+) \}\}")
_VALUE = re.compile(r"\{\{ (\.Values\.[A-Za-z.]+)( \| quote)? \}\}")


def _lookup(values: dict, path: str) -> Any:
    node: Any = values
    for part in path.split(".")[2:]:
        node = node[part]
    return node


def render_file(text: str, values: dict) -> str:
    condition = _IF.search(text)
    if condition:
        if not _END.search(text):
            raise AssertionError("an {{- if }} without its {{- end }} at the end of the file")
        head = text[:condition.start()].rstrip("\n")  # {{- trims the whitespace before it
        body = _END.sub("", text[condition.end():])
        text = head + ("\n" + body if _lookup(values, condition[1]) else "\n")

    def block(m: re.Match) -> str:
        dumped = yaml.safe_dump(_lookup(values, m[1]), default_flow_style=False).rstrip("\n")
        pad = " " * int(m[2])
        return "".join("\n" + pad + line for line in dumped.splitlines())

    text = _TOYAML.sub(block, text)

    def scalar(m: re.Match) -> str:
        value = _lookup(values, m[1])
        return json.dumps(str(value)) if m[2] else str(value)

    text = _VALUE.sub(scalar, text)
    if "{{" in text or "}}" in text:
        raise AssertionError(f"a template form this renderer does not know: {text[text.find('{{'):][:80]!r}")
    return text


def render(chart: Path, overrides: dict | None = None) -> dict[str, Any]:
    """templates/NAME → the object it renders to (None: the file renders to nothing)."""
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for key, value in (overrides or {}).items():
        node = values
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    return {path.name: yaml.safe_load(render_file(path.read_text(), values))
            for path in sorted((chart / "templates").iterdir())}
