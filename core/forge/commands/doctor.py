"""forge doctor: what is installed and what each piece enables."""

from __future__ import annotations

import argparse
import importlib.util
import platform
from importlib import metadata
from pathlib import Path

HELP = "report Python, forge, plugin and toolchain versions and what each enables"

_PACKAGES = (
    ("torch", "export of every family, the python target"),
    ("transformers", "reading Hugging Face checkpoints"),
    ("onnxruntime", "encoder parity checks, --target onnxruntime/python for encoders"),
    ("nvidia-modelopt", "--quant int4_awq / fp8 / int8_kv for decoders"),
    ("tensorrt_llm", "serving the LLM-API layout's tensorrt_llm model (TensorRT-LLM v1.3 on); engine builds up to "
                     "v1.2.1 (trtllm-build ships with it)"),
    ("tensorrt", "TensorRT plans (trtexec ships with TensorRT)"),
    ("nvidia-pytriton", "forge serve on this machine (bundles tritonserver with the python backend)"),
    ("tritonclient", "forge infer / bench, config schema"),
)


def _pkg_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def bundled_tritonserver() -> Path | None:
    """The tritonserver binary inside the nvidia-pytriton wheel, found without importing it."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(list(spec.submodule_search_locations)[0]) / "tritonserver" / "bin" / "tritonserver"
    return binary if binary.is_file() else None


def _layouts() -> list[dict[str, str | None]]:
    """What a decoder build writes for each backend release (--backend-version), newest the default."""
    from .. import profiles

    rows = []
    for layout, what in ((profiles.ENGINE, "--target tensorrtllm: trtllm-build engine, inflight_batcher_llm models"),
                         (profiles.LLMAPI, "--target tensorrtllm: one tensorrt_llm model on the LLM API, model.yaml")):
        versions = [v for v in profiles.known() if profiles.resolve(v).layout == layout]
        if versions:
            default = " (default)" if profiles.NEWEST in versions else ""
            span = versions[0] if len(versions) == 1 else f"{versions[0]} … {versions[-1]}"
            rows.append({"name": f"releases, {layout} layout", "version": span + default, "enables": what})
    return rows


def _vllm_row() -> dict[str, str | None]:
    """The vLLM environment that serves --target vllm repositories here (FORGE_VLLM_PYTHON)."""
    from ..server import vllm_runtime

    python = vllm_runtime.vllm_python()
    version = vllm_runtime.vllm_version(python) if python else None
    return {"name": f"vllm ({vllm_runtime.PYTHON_ENV})", "version": f"{version} ({python})" if version else None,
            "enables": "forge serve of --target vllm repositories on this machine"}


def _cpu_kernels_row() -> dict[str, str | None]:
    """Whether the python target's C kernels for a CPU build and load here, as its decoder loads them at start-up
    (compiled once into forge's cache); without them its CPU step runs through SDPA and torch's ops."""
    row = {"name": "forge CPU kernels", "version": None,
           "enables": "the python target's C attention, RMSNorm and picks on a CPU (else SDPA and torch's ops)"}
    if importlib.util.find_spec("torch") is None:
        return row
    from ..in_triton.python_target.forge_decoder import cpu_kernels

    library, why = cpu_kernels.load()
    row["version"] = f"loaded ({library._name})" if library is not None else f"not used: {why}"
    return row


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print as json")


def run(args: argparse.Namespace) -> int:
    from .. import __version__, toolchain
    from ..registry import registry
    from ..ui import emit_json

    rows: list[dict[str, str | None]] = [
        {"name": "python", "version": platform.python_version(), "enables": "forge"},
        {"name": "forge", "version": __version__, "enables": "forge build / validate / serve"},
    ]
    for info in registry().infos.values():
        rows.append({"name": f"plugin {info.name}", "version": info.version,
                     "enables": f"families {', '.join(info.families) or '-'}"})
    for package, enables in _PACKAGES:
        rows.append({"name": package, "version": _pkg_version(package), "enables": enables})
    bundled = bundled_tritonserver()
    rows.append({"name": "tritonserver (nvidia-pytriton)", "version": str(bundled) if bundled else None,
                 "enables": "forge serve with the python backend (CPU or GPU)"})
    for tool in toolchain.TOOLS:
        rows.append({"name": tool.name, "version": toolchain.version(tool.name, tool.version_args),
                     "enables": tool.enables})
    rows.append(_cpu_kernels_row())
    rows.append(_vllm_row())
    rows += _layouts()
    if args.json:
        emit_json(rows)
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['version'] or 'not found':<28}  {r['enables']}")
    return 0
