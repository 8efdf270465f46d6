"""Build options of the encoder families (``-o key=value`` and first-class flags), checked once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from ..context import BuildContext

PADDINGS = ("longest", "max_length")
DEVICES = ("auto", "cpu", "gpu")
INT8_MODES = ("dynamic", "static")

#: Every option the encoder families read, with what it does (shown by errors and the docs).
OPTIONS = {
    "instances": "instance count of each encoder model (--instances; default 1)",
    "preprocessing_instances": "instance count of each preprocessing model (default 1)",
    "padding": "text padding: longest (python/onnxruntime default) or max_length (tensorrt default)",
    "max_queue_delay_us": "dynamic batching delay of the encoders in microseconds (default 0)",
    "opset": "ONNX opset of the export (default 17)",
    "device": "python/onnxruntime targets: auto, cpu or gpu (default auto)",
    "intra_op_threads": "python target: ONNX Runtime threads per instance (default 0: all cores)",
    "workspace_mib": "tensorrt target: trtexec workspace pool in MiB (default 4096)",
    "timing_cache": "tensorrt target: trtexec timing cache file (default: in the forge cache)",
    "opt_batch_size": "tensorrt target: batch size of the optimisation profile's opt shape",
    "opt_seq_len": "tensorrt target: sequence length of the opt shape (default 128 or max)",
    "trt_version": "tensorrt target: TensorRT version named in the int8 calibration cache (default 10.3.0)",
    "int8_mode": "--quant int8 on python/onnxruntime: dynamic (text default) or static (image default)",
    "calib_size": "number of calibration samples for static int8 / calibration caches (default 64)",
    "quant_parity_tolerance": "max |Δ| allowed after --dtype float16 / --quant int8 (default: the family's)",
    "normalize": "clip: L2-normalise the served embeddings (default false, as get_image_features)",
    "model_name": "clip: open_clip model name when --model is a weights file",
}


def _int(ctx: "BuildContext", key: str, default: int | None, minimum: int) -> int | None:
    value = ctx.option(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"-o {key}={value!r}: expected an integer ≥ {minimum} ({OPTIONS[key]})")
    return value


def _choice(ctx: "BuildContext", key: str, default: str, choices: tuple[str, ...]) -> str:
    value = ctx.option(key, default)
    if value not in choices:
        raise UsageError(f"-o {key}={value!r}: choose one of {', '.join(choices)}")
    return value


def _float(ctx: "BuildContext", key: str) -> float | None:
    value = ctx.option(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UsageError(f"-o {key}={value!r}: expected a positive number ({OPTIONS.get(key, key)})")
    return float(value)


@dataclass(frozen=True)
class EncoderOptions:
    """The encoder options of one build, validated."""

    instances: int
    preprocessing_instances: int
    padding: str
    max_queue_delay_us: int | None
    opset: int
    device: str
    intra_op_threads: int
    workspace_mib: int
    timing_cache: Path
    opt_batch_size: int | None
    opt_seq_len: int | None
    trt_version: str
    int8_mode: str | None
    calib_size: int
    parity_tolerance: float | None
    quant_parity_tolerance: float | None
    normalize: bool

    @classmethod
    def read(cls, ctx: "BuildContext") -> "EncoderOptions":
        from ..cache import cache_dir

        target = ctx.target
        normalize = ctx.option("normalize", False)
        if not isinstance(normalize, bool):
            raise UsageError(f"-o normalize={normalize!r}: expected true or false")
        opset = _int(ctx, "opset", 17, 13)
        if opset > 21:
            raise UsageError(f"-o opset={opset}: the exporter supports opsets 13 to 21")
        trt_version = str(ctx.option("trt_version", "10.3.0"))
        if not all(p.isdigit() for p in trt_version.split(".")) or len(trt_version.split(".")) != 3:
            raise UsageError(f"-o trt_version={trt_version!r}: expected MAJOR.MINOR.PATCH, e.g. 10.3.0")
        calib = ctx.option("calib_data")
        if calib is not None and not Path(calib).exists():
            raise UsageError(f"--calib-data {calib} does not exist")
        return cls(
            instances=_int(ctx, "instances", 1, 1),
            preprocessing_instances=_int(ctx, "preprocessing_instances", 1, 1),
            padding=_choice(ctx, "padding", "max_length" if target == "tensorrt" else "longest", PADDINGS),
            max_queue_delay_us=_int(ctx, "max_queue_delay_us", None, 0),
            opset=opset,
            device=_choice(ctx, "device", "auto", DEVICES),
            intra_op_threads=_int(ctx, "intra_op_threads", 0, 0),
            workspace_mib=_int(ctx, "workspace_mib", 4096, 1),
            timing_cache=Path(ctx.option("timing_cache", cache_dir() / "tensorrt" / "timing.cache")),
            opt_batch_size=_int(ctx, "opt_batch_size", None, 1),
            opt_seq_len=_int(ctx, "opt_seq_len", None, 1),
            trt_version=trt_version,
            int8_mode=_choice(ctx, "int8_mode", "", ("",) + INT8_MODES) or None,
            calib_size=_int(ctx, "calib_size", 64, 1),
            parity_tolerance=_float(ctx, "parity_tolerance"),
            quant_parity_tolerance=_float(ctx, "quant_parity_tolerance"),
            normalize=normalize,
        )

    def calib_data(self, ctx: "BuildContext") -> Path | None:
        value = ctx.option("calib_data")
        return Path(value) if value is not None else None

