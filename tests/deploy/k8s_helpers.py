"""Run ``forge deploy k8s`` and read what it wrote; validate objects strictly, offline.

Core objects: ``kubernetes-validate`` in strict mode (unknown fields are errors) against the three newest
Kubernetes minors it ships. Custom resources: the CRDs' own OpenAPI v3 schemas, vendored in ``schemas/`` (see
``schemas/PROVENANCE.json``), with unknown fields made errors as ``kubectl apply --validate=strict`` does.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import yaml

from forge.cli import main

SCHEMAS = Path(__file__).parent / "schemas"
CRD_GROUPS = ("leaderworkerset.x-k8s.io", "serving.kserve.io", "keda.sh", "monitoring.coreos.com")


def deploy(repo: Path, out: Path, *argv: Any) -> int:
    return main(["deploy", "k8s", str(repo), "--out", str(out), *map(str, argv)])


def read_dir(out: Path) -> dict[str, dict]:
    """File name → object of every resource kustomization.yaml lists (in its order)."""
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    return {name: yaml.safe_load((out / name).read_text()) for name in kustomization["resources"]}


def by_kind(objects: dict[str, dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objects.values()}


@functools.lru_cache(maxsize=None)
def minors() -> tuple[str, ...]:
    """The three newest Kubernetes minors kubernetes-validate ships schemas for."""
    from kubernetes_validate import utils

    found = sorted({tuple(int(x) for x in v.split(".")[:2]) for v in utils.all_versions()})
    return tuple(f"{major}.{minor}" for major, minor in found[-3:])


def _strict(node: Any) -> Any:
    """Unknown fields become errors: every object schema with properties, and no say of its own, closes."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _strict(v) if k not in ("enum", "default", "example") else v for k, v in node.items()}
    if "properties" in node and "additionalProperties" not in node and \
            not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
    return node


@functools.lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str):
    import jsonschema

    group, version = api_version.split("/")
    path = SCHEMAS / f"{group}_{version}_{kind.lower()}.json"
    schema = _strict(json.loads(path.read_text()))
    # metadata is ObjectMeta (the API server checks it); the CRD schema says only "object"
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict) -> list[str]:
    """Problems of one object (empty: valid on every supported minor, or against its CRD)."""
    import kubernetes_validate

    problems = []
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    if group in CRD_GROUPS:
        for error in crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj):
            problems.append(f"{obj['kind']} {'/'.join(map(str, error.absolute_path))}: {error.message}")
        return problems
    for version in minors():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{obj['kind']} on {version}: {'/'.join(map(str, exc.path))}: {exc.message}")
    return problems


def pods_of(obj: dict) -> list[dict]:
    """The pod templates of a workload, as Pods (validated like any core object)."""
    if obj["kind"] == "Deployment":
        templates = [obj["spec"]["template"]]
    elif obj["kind"] == "LeaderWorkerSet":
        t = obj["spec"]["leaderWorkerTemplate"]
        templates = [t["leaderTemplate"], t["workerTemplate"]]
    else:
        return []
    return [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **t["metadata"]}, "spec": t["spec"]}
            for t in templates]
