"""Build options of the encoder families (``-o key=value`` and first-class flags): declared once, read from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..components import Option
from ..contract import check_value
from ..errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from ..context import BuildContext

PADDINGS = ("longest", "max_length")
DEVICES = ("auto", "cpu", "gpu")
INT8_MODES = ("dynamic", "static")

ALL = ()  # every target of the family
ONNX_TARGETS = ("python", "onnxruntime")
TENSORRT = ("tensorrt",)

#: Every option the encoder families read (family-specific ones: ``EncoderAdapter.options``).
OPTIONS = (
    Option("instances", "int", "instance count of each encoder model", 1, minimum=1, flag="--instances"),
    Option("preprocessing_instances", "int", "instance count of each preprocessing model", 1, minimum=1),
    Option("padding", "choice", "text padding (default: longest; max_length on tensorrt)", None,
           choices=PADDINGS),
    Option("max_queue_delay_us", "int", "dynamic batching delay of the encoders in microseconds", 0, minimum=0),
    Option("opset", "int", "ONNX opset of the export (13 to 21)", 17, minimum=13),
    Option("device", "choice", "where the encoder runs", "auto", ONNX_TARGETS, choices=DEVICES),
    Option("intra_op_threads", "int", "ONNX Runtime threads per instance (0: all cores)", 0, ("python",),
           minimum=0),
    Option("workspace_mib", "int", "trtexec workspace pool in MiB", 4096, TENSORRT, minimum=1),
    Option("timing_cache", "path", "trtexec timing cache file (default: in the forge cache)", None, TENSORRT),
    Option("opt_batch_size", "int", "batch size of the optimisation profile's opt shape", None, TENSORRT,
           minimum=1),
    Option("opt_seq_len", "int", "sequence length of the opt shape (default 128 or max)", None, TENSORRT,
           minimum=1),
    Option("trt_version", "str", "TensorRT version named in the int8 calibration cache", "10.3.0", TENSORRT),
    Option("int8_mode", "choice", "--quant int8 with ONNX Runtime: dynamic (text default) or static "
           "(image default)", None, ONNX_TARGETS, choices=INT8_MODES),
    Option("calib_size", "int", "calibration samples for static int8 / calibration caches", 64, minimum=1),
    Option("calib_data", "path", "calibration data: a text file (one sample a line) or a folder of images",
           None, flag="--calib-data"),
    Option("parity_tolerance", "float", "max |Δ| of the float32 export against torch (default: the family's)",
           None, exclusive_minimum=0, flag="--parity-tolerance"),
    Option("quant_parity_tolerance", "float", "max |Δ| allowed after --dtype float16 / --quant int8 "
           "(default: the family's)", None, exclusive_minimum=0),
)
_DECLARED = {o.name: o for o in OPTIONS}


def _given(ctx: "BuildContext", key: str) -> Any:
    """``-o key`` as given, else its declared default; checked against its declaration (the driver has done so
    before any stage runs; a caller without a driver gets the same check)."""
    option = _DECLARED[key]
    value = ctx.option(key, option.default)
    if value is not None:
        check_value(option, value)
    return value


def _number(ctx: "BuildContext", key: str) -> float | None:
    value = _given(ctx, key)
    return None if value is None else float(value)


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
        opset = _given(ctx, "opset")
        if opset > 21:
            raise UsageError(f"-o opset={opset}: the exporter supports opsets 13 to 21")
        trt_version = str(_given(ctx, "trt_version"))
        if not all(p.isdigit() for p in trt_version.split(".")) or len(trt_version.split(".")) != 3:
            raise UsageError(f"-o trt_version={trt_version!r}: expected MAJOR.MINOR.PATCH, e.g. 10.3.0")
        calib = ctx.option("calib_data")
        if calib is not None and not Path(calib).exists():
            raise UsageError(f"--calib-data {calib} does not exist")
        return cls(
            instances=_given(ctx, "instances"),
            preprocessing_instances=_given(ctx, "preprocessing_instances"),
            padding=_given(ctx, "padding") or ("max_length" if target == "tensorrt" else "longest"),
            max_queue_delay_us=_given(ctx, "max_queue_delay_us"),
            opset=opset,
            device=_given(ctx, "device"),
            intra_op_threads=_given(ctx, "intra_op_threads"),
            workspace_mib=_given(ctx, "workspace_mib"),
            timing_cache=Path(_given(ctx, "timing_cache") or cache_dir() / "tensorrt" / "timing.cache"),
            opt_batch_size=_given(ctx, "opt_batch_size"),
            opt_seq_len=_given(ctx, "opt_seq_len"),
            trt_version=trt_version,
            int8_mode=_given(ctx, "int8_mode"),
            calib_size=_given(ctx, "calib_size"),
            parity_tolerance=_number(ctx, "parity_tolerance"),
            quant_parity_tolerance=_number(ctx, "quant_parity_tolerance"),
            normalize=normalize,
        )

    def calib_data(self, ctx: "BuildContext") -> Path | None:
        value = ctx.option("calib_data")
        return Path(value) if value is not None else None

