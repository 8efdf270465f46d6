"""Hugging Face PEFT LoRA adapters → TensorRT-LLM's LoRA format, checked against the base model.

TensorRT-LLM's runtime (and tensorrtllm_backend's ``lora_weights`` / ``lora_config`` inputs) take one
adapter as two arrays (TensorRT-LLM ``docs/source/advanced/lora.md``, ``examples/hf_lora_convert.py``):

* ``lora_config`` [num_lora_modules_layers, 3] int32: per row (module id, layer index, adapter size D),
  module ids from ``LoraManager.LORA_MODULE_IDS`` (:data:`MODULE_IDS`);
* ``lora_weights`` [num_lora_modules_layers, D×Hi + Ho×D]: per row the flattened ``in`` matrix
  [D, Hi] (PEFT ``lora_A``) followed by the flattened ``out`` matrix [Ho, D] (PEFT ``lora_B``) with the
  adapter's scaling folded in (alpha / D, or alpha / √D under rsLoRA); rows of smaller adapters are
  zero-padded to the longest row. The arrays hold every tensor-parallel rank's weights (the runtime
  splits them); :func:`shard` is that split.

``hf_lora_convert.py`` saves both with a leading batch dimension of 1 (``model.lora_weights.npy``,
``model.lora_config.npy``), which is how a client sends them; :func:`repository_files` does the same, under
a directory named by the task id (tensorrtllm_backend's ``lora_prefetch_dir`` layout).

Adapters are read from safetensors only; anything the format cannot carry is refused with one line.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from forge.errors import UsageError
from forge.spec import check_name

from .adapter import COLUMN, KV, QKV, ROW, DecoderAdapter, LoraTarget

#: TensorRT-LLM's LoRA module ids (tensorrt_llm/lora_manager.py ``LoraManager.LORA_MODULE_IDS``).
MODULE_IDS: Mapping[str, int] = {
    "attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4, "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6, "mlp_gate": 7, "cross_attn_qkv": 8, "cross_attn_q": 9, "cross_attn_k": 10,
    "cross_attn_v": 11, "cross_attn_dense": 12, "moe_h_to_4h": 13, "moe_4h_to_h": 14, "moe_gate": 15,
    "moe_router": 16, "mlp_router": 17, "mlp_gate_up": 18,
}
WEIGHTS_FILE = "model.lora_weights.npy"
CONFIG_FILE = "model.lora_config.npy"
_PEFT_PREFIX = "base_model.model."
_QKV_PARTS = ("attn_q", "attn_k", "attn_v")


@dataclass(frozen=True)
class Module:
    """One LoRA module of one layer: PEFT's A [D, Hi] and B [Ho, D] with the scaling folded into B."""

    layer: int
    path: str  # the transformers module, e.g. transformer.h.0.attn.c_attn
    target: LoraTarget
    a: np.ndarray  # float32 [D, Hi]
    b: np.ndarray  # float32 [Ho, D], scaled

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class Adapter:
    """A checked PEFT adapter in TensorRT-LLM's terms."""

    name: str
    source: Path
    sha256: str
    modules: list[Module]
    base_model: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def module_names(self) -> list[str]:
        """TensorRT-LLM module names, in the family's declaration order."""
        seen = dict.fromkeys(m.target.module for m in self.modules)
        return list(seen)

    def arrays(self, dtype: Any = np.float16) -> tuple[np.ndarray, np.ndarray]:
        """(lora_weights [N, max(D×Hi + Ho×D)], lora_config [N, 3]) for every rank (unsplit)."""
        return _pack(self.modules, dtype)


def parse_option(value: Any) -> dict[str, Path]:
    """``--lora NAME=DIR`` values (a mapping, or "NAME=DIR,NAME=DIR" from ``-o lora=``) → {name: dir}."""
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = []
        for part in (p.strip() for p in str(value).split(",") if p.strip()):
            name, sep, path = part.partition("=")
            if not sep or not name or not path:
                raise UsageError(f"--lora takes NAME=DIR, got {part!r}")
            items.append((name, path))
    result: dict[str, Path] = {}
    for name, path in items:
        check_name(str(name), "LoRA adapter name")
        if name in result:
            raise UsageError(f"--lora {name} is given twice; give each adapter its own name")
        result[str(name)] = Path(path)
    if not result:
        raise UsageError("--lora needs at least one NAME=DIR")
    return result


def source_hash(directory: Path) -> str:
    """sha256 over the adapter's config and weights (what the manifest records)."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        path = directory / name
        if path.is_file():
            digest.update(name.encode())
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


# -- reading and checking -----------------------------------------------------------------------

def _config(name: str, directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise UsageError(f"LoRA adapter {name}: {directory} is not a directory")
    path = directory / "adapter_config.json"
    if not path.is_file():
        raise UsageError(f"LoRA adapter {name}: {directory} has no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"LoRA adapter {name}: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"LoRA adapter {name}: {path} is not a json object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise UsageError(f"LoRA adapter {name}: peft_type {kind} is not LoRA; TensorRT-LLM serves LoRA adapters only")
    if config.get("use_dora"):
        raise UsageError(f"LoRA adapter {name}: DoRA (use_dora) has a magnitude vector that the backend's "
                         "lora_weights / lora_config inputs cannot carry")
    if config.get("bias", "none") not in ("none", None):
        raise UsageError(f"LoRA adapter {name}: bias={config['bias']} trains biases, which TensorRT-LLM's LoRA "
                         "cannot apply; retrain with bias='none'")
    if config.get("modules_to_save"):
        raise UsageError(f"LoRA adapter {name}: modules_to_save {config['modules_to_save']} replaces whole "
                         "modules, which a per-request LoRA cannot do; merge the adapter into the model instead")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UsageError(f"LoRA adapter {name}: adapter_config.json has r={rank!r}; expected a positive integer")
    return config


def _weights_file(name: str, directory: Path) -> Path:
    path = directory / "adapter_model.safetensors"
    if path.is_file():
        return path
    if (directory / "adapter_model.bin").is_file():
        raise UsageError(f"LoRA adapter {name}: {directory} has only adapter_model.bin (pickle), which forge does "
                         "not load; save it with save_pretrained(..., safe_serialization=True)")
    raise UsageError(f"LoRA adapter {name}: {directory} has no adapter_model.safetensors")


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the module name or its dotted tail."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({key})", module):
            return value
    return default


def _check_targets(name: str, family: DecoderAdapter, config: Mapping[str, Any]) -> None:
    """Every name in target_modules must be a module the family can serve with LoRA."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):  # a regex (or none): the weights say what is targeted
        return
    paths = [p.replace("{i}", "0") for p in family.lora_targets]
    for target in sorted(targets):  # PEFT saves a set: its order varies
        if not any(p == target or p.endswith("." + target) for p in paths):
            known = ", ".join(sorted({p.rsplit(".", 1)[-1] for p in paths}))
            raise UsageError(f"LoRA adapter {name}: unknown target module {target!r} for family {family.family} "
                             f"(TensorRT-LLM LoRA modules of this family: {known})")


def _matchers(family: DecoderAdapter) -> list[tuple[re.Pattern, str, LoraTarget]]:
    result = []
    for path, target in family.lora_targets.items():
        regex = re.escape(path).replace(r"\{i\}", r"(\d+)")
        result.append((re.compile(rf"{regex}\.lora_([AB])(?:\.default)?\.weight"), path, target))
    return result


def read(name: str, directory: Path, family: DecoderAdapter, norm: Mapping[str, Any], *,
         base_dir: Path | None = None, base_name: str | None = None) -> Adapter:
    """Read and check one PEFT adapter against the base model's normalized config ``norm``."""
    from .tensorio import SafetensorsFile, to_float32

    directory = Path(directory)
    config = _config(name, directory)
    if not family.lora_targets:
        raise UsageError(f"family {family.family} declares no LoRA modules; --lora is not available for it")
    _check_targets(name, family, config)
    weights_path = _weights_file(name, directory)
    from forge.hf import safetensors_header

    safetensors_header(weights_path)  # truncated files fail here with one line
    file = SafetensorsFile(weights_path)
    try:
        pairs: dict[tuple[str, int], dict[str, np.ndarray]] = {}
        matchers = _matchers(family)
        for key, ref in file.refs.items():
            inner = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
            for regex, path, target in matchers:
                m = regex.fullmatch(inner)
                if m:
                    layer, side = int(m.group(1)), m.group(2)
                    if ref.tag not in ("F32", "F16", "BF16"):
                        raise UsageError(f"LoRA adapter {name}: {key} has dtype {ref.tag}; expected a float tensor")
                    pairs.setdefault((path, layer), {})[side] = to_float32(np.array(ref.array()), ref.tag)
                    break
            else:
                module = re.sub(r"\.lora_\w+.*$", "", inner)
                raise UsageError(f"LoRA adapter {name}: unknown target module {module!r} for family {family.family} "
                                 f"(tensor {key}); TensorRT-LLM applies LoRA to "
                                 f"{', '.join(p.rsplit('.', 1)[-1] for p in family.lora_targets)} only")
    finally:
        file.close()
    if not pairs:
        raise UsageError(f"LoRA adapter {name}: {weights_path.name} holds no LoRA weights")

    num_layers = int(norm["num_layers"])
    rank_default, alpha_default = int(config["r"]), config.get("lora_alpha", config["r"])
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    order = {path: n for n, path in enumerate(family.lora_targets)}
    modules = []
    for (path, layer), sides in sorted(pairs.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        module = path.format(i=layer)
        if layer >= num_layers:
            raise UsageError(f"LoRA adapter {name}: base-model mismatch: {module} is layer {layer}, but the base "
                             f"model has {num_layers} layers")
        if set(sides) != {"A", "B"}:
            missing = "lora_B" if "A" in sides else "lora_A"
            raise UsageError(f"LoRA adapter {name}: {module} has no {missing} weight")
        a, b = sides["A"], sides["B"]
        target = family.lora_targets[path]
        out_dim, in_dim = (int(norm[d]) for d in target.dims)
        expected = int(_pattern(rank_pattern, module, rank_default))
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise UsageError(f"LoRA adapter {name}: rank mismatch in {module}: lora_A {list(a.shape)} and "
                             f"lora_B {list(b.shape)} do not share a rank")
        if a.shape[0] != expected:
            raise UsageError(f"LoRA adapter {name}: rank mismatch in {module}: its weights have rank {a.shape[0]} "
                             f"but adapter_config.json says {expected} (r / rank_pattern)")
        if a.shape[1] != in_dim or b.shape[0] != out_dim:
            raise UsageError(f"LoRA adapter {name}: base-model mismatch: {module} maps {a.shape[1]} → {b.shape[0]} "
                             f"features, the base model's {module.rsplit('.', 1)[-1]} maps {in_dim} → {out_dim}")
        alpha = float(_pattern(alpha_pattern, module, alpha_default))
        scale = alpha / (np.sqrt(expected) if rslora else expected)
        modules.append(Module(layer, module, target, np.ascontiguousarray(a, np.float32),
                              np.ascontiguousarray(b * np.float32(scale), np.float32)))

    adapter = Adapter(name, directory, source_hash(directory), modules, config.get("base_model_name_or_path"))
    declared = adapter.base_model
    if declared and base_dir is not None:
        known = {Path(str(base_dir)).name, Path(str(base_name or "")).name}
        if Path(str(declared).rstrip("/")).name not in known:
            adapter.warnings.append(f"LoRA adapter {name} was trained on {declared!r}, not on {base_dir.name!r}; "
                                    "its shapes match, so it is used")
    return adapter


# -- TensorRT-LLM arrays ------------------------------------------------------------------------

def _pack(modules: list[Module], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    rows = [np.concatenate([m.a.reshape(-1), m.b.reshape(-1)]) for m in modules]
    width = max(r.size for r in rows)
    weights = np.zeros((len(rows), width), dtype=dtype)
    for n, row in enumerate(rows):
        weights[n, :row.size] = row
    config = np.array([[MODULE_IDS[m.target.module], m.layer, m.rank] for m in modules], dtype=np.int32)
    return weights, config


def build_modules(module_lists: list[list[str]]) -> list[str]:
    """``trtllm-build --lora_target_modules``: every adapter's modules, with Q, K, V enabled together
    (TensorRT-LLM's LoraManager.get_missing_qkv_modules)."""
    modules = dict.fromkeys(m for names in module_lists for m in names)
    if any(m in modules for m in _QKV_PARTS):
        modules.update(dict.fromkeys(_QKV_PARTS))
    return sorted(modules, key=MODULE_IDS.__getitem__)


def _kv_rows(norm: Mapping[str, Any], tp: int, rank: int) -> tuple[int, int]:
    """(start, rows) of rank ``rank``'s K (or V) rows: forge's QKV sharding (KV heads copied if < tp)."""
    kv, d = int(norm["num_kv_heads"]), int(norm["head_size"])
    if kv >= tp:
        rows = kv * d // tp
        return rank * rows, rows
    return (rank * kv // tp) * d, d


def shard_module(m: Module, norm: Mapping[str, Any], tp: int, rank: int) -> Module:
    """Rank ``rank``'s part of one module (TensorRT-LLM's LoRA split: B rows of column-parallel layers,
    A columns of row-parallel ones; fused QKV per head group, like the base weight)."""
    if tp == 1:
        return m
    split, a, b = m.target.split, m.a, m.b

    def cut(size: int) -> int:
        if size % tp:
            raise UsageError(f"LoRA module {m.path}: {size} features cannot be split over --tp {tp}")
        return size // tp

    if split == ROW:
        n = cut(a.shape[1])
        a = a[:, rank * n:(rank + 1) * n]
    elif split == COLUMN:
        n = cut(b.shape[0])
        b = b[rank * n:(rank + 1) * n]
    elif split == KV:
        start, rows = _kv_rows(norm, tp, rank)
        b = b[start:start + rows]
    elif split == QKV:
        q_dim, kv_dim = int(norm["q_dim"]), int(norm["kv_dim"])
        q = cut(q_dim)
        start, rows = _kv_rows(norm, tp, rank)
        b = np.concatenate([b[rank * q:(rank + 1) * q], b[q_dim + start:q_dim + start + rows],
                            b[q_dim + kv_dim + start:q_dim + kv_dim + start + rows]])
    else:
        raise UsageError(f"LoRA module {m.path}: unknown split {split!r}")  # adapter bug, not user input
    return Module(m.layer, m.path, m.target, np.ascontiguousarray(a), np.ascontiguousarray(b))


def shard(adapter: Adapter, norm: Mapping[str, Any], tp: int, rank: int,
          dtype: Any = np.float16) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights, lora_config) of one tensor-parallel rank."""
    return _pack([shard_module(m, norm, tp, rank) for m in adapter.modules], dtype)


def read_all(spec_value: Any, family: DecoderAdapter, norm: Mapping[str, Any], base_dir: Path,
             base_name: str | None = None) -> list[Adapter]:
    """Every ``--lora`` adapter of a build, read and checked, in the order given (task ids 1, 2, …)."""
    return [read(name, path, family, norm, base_dir=base_dir, base_name=base_name)
            for name, path in parse_option(spec_value).items()]


# -- a build's adapters -------------------------------------------------------------------------

FOLDER = "lora"  # inside the tensorrt_llm model directory: lora/<task id>/model.lora_*.npy


def for_build(family: DecoderAdapter, spec, source: Path) -> list[Adapter]:
    """The ``--lora`` adapters of a build, checked against the base checkpoint's config."""
    from forge.hf import read_json

    config = read_json(Path(source) / "config.json", "the model config")
    norm = family.normalize(config)
    return read_all(spec.options["lora"], family, norm, Path(source), config.get("_name_or_path"))


def summary(adapters: list[Adapter]) -> dict[str, dict[str, Any]]:
    """name → what later stages and the manifest need (task ids follow the --lora order, from 1)."""
    return {a.name: {"task_id": n, "source": str(a.source.resolve()), "sha256": a.sha256, "rank": a.rank,
                     "modules": a.module_names, "layers": len({m.layer for m in a.modules}),
                     "path": f"{FOLDER}/{n}"}
            for n, a in enumerate(adapters, start=1)}


def build_flags(lora: Mapping[str, Mapping[str, Any]], dtype: str) -> list[str]:
    """The ``trtllm-build`` LoRA flags (TensorRT-LLM 0.9+) for a build's adapters (:func:`summary`)."""
    entries = list(lora.values())
    # --lora_ckpt_source stays at its default (hf), so the line does not depend on when that flag appeared
    return ["--lora_plugin", dtype, "--lora_dir", *(e["source"] for e in entries),
            "--lora_target_modules", *build_modules([e["modules"] for e in entries]),
            "--max_lora_rank", str(max(e["rank"] for e in entries))]


def check_build(spec, profile, adapters: list[Adapter]) -> None:
    """Refuse ``--lora`` where the chosen backend version or option values cannot serve the adapters."""
    from ..profiles import BUILD_FLAGS, PROFILES, parse_version

    if profile.llmapi:  # adapters by name (LoRARequest); check_llmapi_modules holds them to the release
        rank = max(a.rank for a in adapters)
        limit = spec.options.get("max_lora_rank")
        if limit is not None and int(limit) < rank:
            raise UsageError(f"adapter rank {rank} exceeds -o max_lora_rank={limit}", hint=f"set it to {rank} or more")
        return
    if profile.interface("tensorrt_llm").input("lora_weights") is None:
        first = next(p.version for p in PROFILES.values() if p.interface("tensorrt_llm").input("lora_weights"))
        raise UsageError(f"--lora needs tensorrtllm_backend {first} or newer; --backend-version {profile.version} "
                         "has no lora_weights / lora_config inputs")
    target = spec.target or "tensorrtllm"
    if target == "tensorrtllm" and parse_version(spec.backend_version) < BUILD_FLAGS["lora_dir"]:
        raise UsageError(f"--lora with --target tensorrtllm needs TensorRT-LLM 0.9 or newer (trtllm-build --lora_dir, "
                         f"--lora_target_modules, --max_lora_rank); --backend-version {profile.version} predates them",
                         hint="choose --backend-version v0.9.0 or newer")
    rank = max(a.rank for a in adapters)
    parameter = profile.parameter("tensorrt_llm", "lora_cache_max_adapter_size")
    limit = spec.options.get("lora_cache_max_adapter_size", parameter.default if parameter else None)
    if limit is not None and int(limit) < rank:
        raise UsageError(f"adapter rank {rank} exceeds lora_cache_max_adapter_size {limit}; the LoRA cache could not "
                         "hold it", hint=f"set -o lora_cache_max_adapter_size={rank}")


def _npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def repository_files(family: DecoderAdapter, spec, source: Path,
                     lora: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    """The adapters in the client form under ``lora/<task id>/`` of the tensorrt_llm model, and one
    manifest entry per adapter (name, task id, rank, modules, source hash, files)."""
    adapters = {a.name: a for a in for_build(family, spec, source)}
    files: dict[str, bytes] = {}
    entries = []
    for name, info in lora.items():
        adapter = adapters[name]
        if adapter.sha256 != info["sha256"]:
            raise UsageError(f"LoRA adapter {name} changed while forge was building ({adapter.source}); build again")
        weights, config = adapter.arrays(np.float16)
        files[f"{info['path']}/{WEIGHTS_FILE}"] = _npy(weights[None])
        files[f"{info['path']}/{CONFIG_FILE}"] = _npy(config[None])
        entries.append({"name": name, "task_id": info["task_id"], "rank": info["rank"], "modules": info["modules"],
                        "module_ids": [MODULE_IDS[m] for m in info["modules"]], "layers": info["layers"],
                        "source": info["source"], "sha256": info["sha256"], "path": info["path"],
                        "lora_weights": [1, *weights.shape], "lora_config": [1, *config.shape],
                        "warnings": adapter.warnings})
    return files, entries


def served_modules(family: DecoderAdapter) -> str:
    """The python target's map of TensorRT-LLM module id → transformers module path (``{i}`` = layer)."""
    return json.dumps({str(MODULE_IDS[t.module]): path for path, t in family.lora_targets.items()},
                      separators=(",", ":"))


#: The TensorRT-LLM modules the LLM API's PyTorch backend takes LoRA weights for (its default mapping to
#: Hugging Face names: attn_q/k/v → q/k/v_proj, attn_dense → o_proj, mlp_h_to_4h → gate_proj,
#: mlp_4h_to_h → down_proj, mlp_gate → up_proj).
LLMAPI_MODULES = frozenset({"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h",
                            "mlp_gate", "mlp_gate_up"})


def check_llmapi_modules(family: DecoderAdapter, spec, profile) -> None:
    """Refuse adapters that patch modules the LLM API's PyTorch backend of ``profile`` takes no LoRA for."""
    for adapter in for_build(family, spec, spec.source_for(family.family)):
        other = sorted(set(adapter.module_names) - LLMAPI_MODULES)
        if other:
            raise UsageError(f"LoRA adapter {adapter.name} patches {', '.join(other)}, which TensorRT-LLM "
                             f"{profile.version}'s PyTorch backend serves no LoRA for",
                             hint=f"it takes {', '.join(sorted(LLMAPI_MODULES))}")
