"""Triton model configs as protobuf messages: build, write with text_format, read back.

There are no string templates: an unfilled value cannot exist because every field is typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from google.protobuf import text_format

from .errors import ValidationError


class _LazyModule:
    """A module imported on first attribute access: ``tritonclient.grpc`` takes ~0.15 s to import (grpc,
    the whole client), which commands that write no config (``forge export``) should not pay."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        import importlib

        module = importlib.import_module(self._name)
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


mc = _LazyModule("tritonclient.grpc.model_config_pb2")

CONFIG_FILE = "config.pbtxt"


def dtype(name: str | int) -> int:
    """``"INT32"``, ``"TYPE_INT32"`` or an enum value → ``DataType`` enum value."""
    if isinstance(name, int):
        return name
    if name in ("BYTES", "TYPE_BYTES"):  # the client-side name of TYPE_STRING
        name = "STRING"
    key = name if name.startswith("TYPE_") else f"TYPE_{name}"
    try:
        return mc.DataType.Value(key)
    except ValueError:
        raise ValidationError(f"unknown Triton data type {name!r}") from None


def dtype_name(value: int) -> str:
    """``DataType`` enum value → ``"INT32"``."""
    return mc.DataType.Name(value).removeprefix("TYPE_")


def model_input(name: str, data_type: str, dims: Iterable[int], *, optional: bool = False,
                reshape: Iterable[int] | None = None, allow_ragged_batch: bool = False) -> mc.ModelInput:
    msg = mc.ModelInput(name=name, data_type=dtype(data_type), dims=list(dims), optional=optional,
                        allow_ragged_batch=allow_ragged_batch)
    if reshape is not None:
        msg.reshape.shape.extend(reshape)
    return msg


def model_output(name: str, data_type: str, dims: Iterable[int]) -> mc.ModelOutput:
    return mc.ModelOutput(name=name, data_type=dtype(data_type), dims=list(dims))


def model_config(name: str, *, backend: str = "", platform: str = "", max_batch_size: int = 0,
                 inputs: Iterable[mc.ModelInput] = (), outputs: Iterable[mc.ModelOutput] = (),
                 parameters: Mapping[str, Any] | None = None, instances: int | None = None,
                 instance_kind: str = "KIND_CPU", dynamic_batching: bool | Mapping[str, Any] = False,
                 decoupled: bool | None = None) -> mc.ModelConfig:
    """One ``ModelConfig``; ``parameters`` values are stringified (Triton's parameters are strings)."""
    config = mc.ModelConfig(name=name, backend=backend, platform=platform,
                            max_batch_size=max_batch_size)
    config.input.extend(inputs)
    config.output.extend(outputs)
    for key, value in (parameters or {}).items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        config.parameters[key].string_value = str(value)
    if instances is not None:
        config.instance_group.add(count=instances, kind=mc.ModelInstanceGroup.Kind.Value(instance_kind))
    if dynamic_batching:
        batching = config.dynamic_batching
        if isinstance(dynamic_batching, Mapping):
            if dynamic_batching.get("max_queue_delay_microseconds") is not None:
                batching.max_queue_delay_microseconds = int(dynamic_batching["max_queue_delay_microseconds"])
            if dynamic_batching.get("preferred_batch_size"):
                batching.preferred_batch_size.extend(dynamic_batching["preferred_batch_size"])
            if dynamic_batching.get("max_queue_size"):
                batching.default_queue_policy.max_queue_size = int(dynamic_batching["max_queue_size"])
        else:
            batching.SetInParent()
    if decoupled is not None:
        config.model_transaction_policy.decoupled = decoupled
    return config


def parameter(config: mc.ModelConfig, key: str, default: str | None = None) -> str | None:
    """A config parameter's string value, or ``default`` when it is not set."""
    if key in config.parameters:
        return config.parameters[key].string_value
    return default


def to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def parse(text: str, where: str = "<config>") -> mc.ModelConfig:
    """Parse config text with the protobuf schema; errors name the file and position."""
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise ValidationError(f"{where}: {exc}") from None


def write(config: mc.ModelConfig, model_dir: Path) -> Path:
    """Write ``model_dir/config.pbtxt`` and read it back to prove it round-trips."""
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / CONFIG_FILE
    text = to_text(config)
    path.write_text(text)
    if parse(path.read_text(), str(path)) != config:
        raise ValidationError(f"{path}: config did not round-trip through text_format")
    return path


def read(path: Path) -> mc.ModelConfig:
    """Read a ``config.pbtxt`` (or a model directory containing one)."""
    if path.is_dir():
        path = path / CONFIG_FILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValidationError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(text, str(path))
