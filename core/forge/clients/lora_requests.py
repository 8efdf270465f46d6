"""Clients of LoRA repositories: adapter names → task ids and tensors, with the backend's cache protocol.

A repository built with ``--lora NAME=DIR`` lists its adapters in the manifest (name, task id, rank,
modules, files under the tensorrt_llm model's ``lora/<task id>/``). tensorrtllm_backend caches an adapter
under its task id once a request carried ``lora_weights`` / ``lora_config``; later requests send only
``lora_task_id``, and a server that does not hold the id (never sent, or evicted) answers with an error.
:class:`LoraRequests` follows that protocol: weights on the first use in this process, the id alone after,
and one retry with weights when the server says it does not know the id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, TypeVar

import numpy as np

from ..errors import ForgeError, UsageError

UNKNOWN_TASK = "not found in cache"  # tensorrtllm_backend's (and forge's python target's) answer
T = TypeVar("T")


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter of a repository: its task id and the files a client sends."""

    name: str
    task_id: int
    weights: Path | None = None  # model.lora_weights.npy (None: the id alone, the server must hold it)
    config: Path | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self.weights is None or self.config is None:
            raise UsageError(f"LoRA task {self.task_id} is not in a repository forge can read the weights from",
                             hint="name the adapter and pass --repo REPO")
        return np.load(self.weights), np.load(self.config)


def repository_adapters(repo: Path) -> dict[str, ServedAdapter]:
    """The adapters a repository's manifest lists, by name."""
    from ..publish import MANIFEST

    path = Path(repo) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{repo} is not a forge repository (no {MANIFEST})") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    found: dict[str, ServedAdapter] = {}
    for component in manifest.get("components", []):
        for stage in component.get("stages", []):
            note = (stage.get("notes") or {}).get("lora")
            if not note:
                continue
            model_dir = Path(repo) / note["model"]
            for entry in note["adapters"]:
                folder = model_dir / entry["path"]
                found[entry["name"]] = ServedAdapter(entry["name"], int(entry["task_id"]),
                                                     folder / "model.lora_weights.npy", folder / "model.lora_config.npy")
    return found


def resolve(names: list[str], repo: Path | None) -> list[ServedAdapter]:
    """``--lora`` values: adapter names of ``repo``'s manifest (or bare task ids the server already holds)."""
    known = repository_adapters(repo) if repo is not None else {}
    result = []
    for name in names:
        if name in known:
            result.append(known[name])
        elif name.isdigit() and repo is None:
            result.append(ServedAdapter(name, int(name)))
        elif repo is None:
            raise UsageError(f"--lora {name} needs --repo REPO (the repository whose manifest names the adapter), "
                             "or a task id the server already holds")
        else:
            listed = ", ".join(sorted(known)) or "none (build it with --lora NAME=DIR)"
            raise UsageError(f"{repo} has no LoRA adapter {name!r}; its adapters: {listed}")
    return result


class LoraRequests:
    """Adds LoRA tensors to requests of one client, sending each adapter's weights only when needed."""

    def __init__(self, inputs, *, weights_first: bool = True):
        # the LLM-API model: each request names its adapter (lora_id, lora_name, lora_path under the model's lora/)
        self.by_name = {"lora_id", "lora_name", "lora_path"} <= set(inputs.inputs)
        missing = [n for n in ("lora_task_id", "lora_weights", "lora_config") if n not in inputs.inputs]
        if missing and not self.by_name:
            raise UsageError(f"model {inputs.name!r} has no {missing[0]} input; LoRA adapters reach the ensemble from "
                             "tensorrtllm_backend v0.15.0 on (ask tensorrt_llm directly, or rebuild with a newer "
                             "--backend-version)")
        self.inputs = inputs
        self.weights_first = weights_first
        self.sent: set[int] = set()
        self.retries = 0

    def tensors(self, adapter: ServedAdapter, with_weights: bool) -> dict[str, np.ndarray]:
        if self.by_name:  # the server loads the adapter from its own copy: nothing else to send
            return {"lora_id": self.inputs.array("lora_id", adapter.task_id),
                    "lora_name": self.inputs.array("lora_name", adapter.name),
                    "lora_path": self.inputs.array("lora_path", adapter.name)}
        extra = {"lora_task_id": self.inputs.array("lora_task_id", adapter.task_id)}
        if with_weights:
            weights, config = adapter.arrays()
            dtype = {"FP16": np.float16, "BF16": np.float32, "FP32": np.float32}.get(
                self.inputs.inputs["lora_weights"][0], np.float16)
            extra["lora_weights"] = weights.astype(dtype).reshape(1, *weights.shape[-2:])
            extra["lora_config"] = config.astype(np.int32).reshape(1, *config.shape[-2:])
        return extra

    def call(self, adapter: ServedAdapter | None, send: Callable[[Mapping[str, np.ndarray]], T]) -> T:
        """``send(extra tensors)`` for ``adapter`` (None: the base model), retried once with weights."""
        if adapter is None:
            return send({})
        first = self.weights_first and adapter.task_id not in self.sent and adapter.weights is not None
        try:
            result = send(self.tensors(adapter, first))
        except ForgeError as exc:
            if first or UNKNOWN_TASK not in str(exc) or adapter.weights is None:
                raise
            self.retries += 1
            result = send(self.tensors(adapter, True))
        self.sent.add(adapter.task_id)
        return result

