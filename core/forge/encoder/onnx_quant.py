"""Quantize stage: float16 / int8 through ONNX Runtime's tools, or an int8 calibration cache for TensorRT.

python and onnxruntime targets: ``--dtype float16`` converts the graph (inputs and outputs stay as
they are); ``--quant int8`` quantizes MatMul/Gemm/Conv weights to int8, dynamically (activations
scaled per batch at run time: the text default) or statically from a calibration set (QDQ: the
image default). Parity against torch float32 is measured again and checked.

tensorrt target: float16 is the ``--fp16`` flag of trtexec (compile stage). int8 keeps the float32
ONNX and writes TensorRT's calibration cache from ONNX Runtime's entropy calibration over the
calibration set, for ``trtexec --int8 --calib``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from ..components import Artifact, Component
from ..context import BuildContext
from ..errors import ForgeError
from . import layout, encoder_parity, samples
from .adapter import TEXT, EncoderAdapter, TowerInterface
from .encoder_options import EncoderOptions
from .input_models import image_preprocessor, text_tokenizer

QUANTIZED_OPS = ["MatMul", "Gemm", "Conv"]  # norms, softmax and pooling stay in float
CALIBRATION_BATCH = 8


def quantize(adapter: EncoderAdapter, component: Component, artifact: Artifact, ctx: BuildContext) -> Artifact | None:
    """The stage hook's body; None when there is nothing to do for this target and precision."""
    int8 = "int8" in ctx.spec.quant
    kept = component.options.get("dtype") == "float32"  # the default dtype left at float32 (plugin.cpu_float32)
    fp16 = not kept and ctx.spec.dtype == "float16"
    if kept and not int8:  # (an int8 graph keeps float32 activations either way)
        why = ("float32 kept: no --dtype given, and ONNX Runtime serves it on a CPU, where float16 is slower "
               "(--dtype float16 converts anyway)")
        ctx.note("dtype", why)
        ctx.log(f"{component.name}: {why}")
    if ctx.target == "tensorrt":
        return calibration_cache(component, artifact, ctx) if int8 else None
    if not (int8 or fp16):
        return None
    opts = EncoderOptions.read(ctx)
    iface = TowerInterface.from_json(artifact.meta["interface"])
    precision = "int8" if int8 else "float16"
    meta = {**artifact.meta, "precision": precision}
    if ctx.dry_run:
        return Artifact("onnx-encoder", ctx.workdir, meta)
    layout.carry(artifact.path, ctx.workdir, layout.ASSETS, encoder_parity.SAMPLES_FILE)
    src, dst = layout.onnx_path(artifact.path), layout.onnx_path(ctx.workdir)
    dst.parent.mkdir(parents=True)
    if int8:
        mode = opts.int8_mode or ("dynamic" if iface.modality == TEXT else "static")
        recipe = _int8(src, dst, mode, iface, opts, artifact.path, ctx)
        if fp16:
            recipe["dtype"] = "float16 not applied: the int8 graph keeps float32 activations"
    else:
        recipe = _float16(src, dst)
    meta["quantization"] = recipe
    ctx.note("quantization", recipe)
    samples_, reference = encoder_parity.load(artifact.path / encoder_parity.SAMPLES_FILE)
    stats = encoder_parity.measure(reference, encoder_parity.onnxruntime_outputs(dst, samples_))
    tolerance = opts.quant_parity_tolerance or adapter.tolerance[precision]
    ctx.note("parity", {**stats, "tolerance": tolerance, "precision": precision, "against": "torch float32",
                        "runtime": "onnxruntime CPUExecutionProvider"})
    encoder_parity.check(stats, tolerance, f"{component.name}: {precision} parity",
                 "raise it with -o quant_parity_tolerance=X, or use --calib-data with representative inputs")
    return Artifact("onnx-encoder", ctx.workdir, meta)


def _external(src: Path) -> bool:
    return any(p.name != src.name for p in src.parent.iterdir())


def _float16(src: Path, dst: Path) -> dict[str, Any]:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    converted = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(dst), save_as_external_data=_external(src))
    return {"dtype": "float16", "tool": "onnxruntime.transformers.float16.convert_float_to_float16",
            "keep_io_types": True}


def calibration_feeds(iface: TowerInterface, opts: EncoderOptions, assets: Path, ctx: BuildContext):
    """Preprocessed calibration batches and where the samples came from."""
    if iface.modality == TEXT:
        texts, origin = samples.calibration_texts(opts.calib_data(ctx), opts.calib_size)
        tokenize = text_tokenizer(iface, opts, assets)
        feeds = [tokenize(texts[i:i + CALIBRATION_BATCH]) for i in range(0, len(texts), CALIBRATION_BATCH)]
        return feeds, origin, len(texts)
    images, origin = samples.calibration_images(opts.calib_data(ctx), opts.calib_size)
    preprocess = image_preprocessor(iface)
    try:
        feeds = [{iface.inputs[0].name: preprocess.batch(images[i:i + CALIBRATION_BATCH])}
                 for i in range(0, len(images), CALIBRATION_BATCH)]
    except ValueError as exc:
        raise ForgeError(f"--calib-data: {exc}") from None
    return feeds, origin, len(images)


class _Reader:
    """onnxruntime.quantization's CalibrationDataReader over prepared batches."""

    def __init__(self, feeds: list[dict]):
        self.feeds, self.index = feeds, 0

    def get_next(self):
        if self.index >= len(self.feeds):
            return None
        self.index += 1
        return self.feeds[self.index - 1]

    def rewind(self):
        self.index = 0


def _int8(src: Path, dst: Path, mode: str, iface: TowerInterface, opts: EncoderOptions, previous: Path,
          ctx: BuildContext) -> dict[str, Any]:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    external = _external(src)
    if mode == "dynamic":
        quantize_dynamic(str(src), str(dst), per_channel=True, weight_type=QuantType.QInt8,
                         op_types_to_quantize=QUANTIZED_OPS, use_external_data_format=external)
        return {"quant": "int8", "mode": "dynamic", "weights": "int8 per channel", "activations": "uint8, per batch",
                "ops": QUANTIZED_OPS, "tool": "onnxruntime.quantization.quantize_dynamic"}
    feeds, origin, count = calibration_feeds(iface, opts, previous / layout.ASSETS, ctx)
    model = _preprocessed(src, ctx.workdir / "calibration-input.onnx", external)
    quantize_static(str(model), str(dst), _Reader(feeds), quant_format=QuantFormat.QDQ, per_channel=True,
                    weight_type=QuantType.QInt8, activation_type=QuantType.QInt8,
                    op_types_to_quantize=QUANTIZED_OPS, calibrate_method=CalibrationMethod.MinMax,
                    use_external_data_format=external,
                    extra_options={"CalibTensorRangeSymmetric": False})
    _remove(ctx.workdir / "calibration-input.onnx")
    return {"quant": "int8", "mode": "static", "format": "QDQ", "weights": "int8 per channel",
            "activations": "int8, calibrated min/max", "ops": QUANTIZED_OPS, "calibration": origin,
            "calibration_samples": count, "tool": "onnxruntime.quantization.quantize_static"}


def _preprocessed(src: Path, out: Path, external: bool) -> Path:
    """ONNX Runtime's recommended pre-pass (shape inference, graph optimisation); the input if it fails."""
    try:
        from onnxruntime.quantization.shape_inference import quant_pre_process

        quant_pre_process(str(src), str(out), save_as_external_data=external)
        return out
    except Exception:  # the pre-pass is an optimisation; quantizing the plain graph is still correct
        return src


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def trt_cache_header(version: str) -> str:
    """TensorRT's calibration cache header, e.g. 10.3.0 → ``TRT-100300-EntropyCalibration2``."""
    major, minor, patch = (int(p) for p in version.split("."))
    code = major * 10000 + minor * 100 + patch if major >= 10 else major * 1000 + minor * 100 + patch
    return f"TRT-{code}-EntropyCalibration2"


def write_trt_cache(path: Path, ranges: dict[str, float], version: str) -> None:
    """One line per tensor: its int8 scale (amax / 127) as a big-endian float32 in hex."""
    lines = [trt_cache_header(version)]
    for name in sorted(ranges):
        lines.append(f"{name}: {struct.pack('>f', max(ranges[name], 1e-8) / 127.0).hex()}")
    path.write_text("\n".join(lines) + "\n")


def calibration_cache(component: Component, artifact: Artifact, ctx: BuildContext) -> Artifact:
    """tensorrt + int8: the float32 ONNX plus ``calibration.cache`` for ``trtexec --int8 --calib``."""
    opts = EncoderOptions.read(ctx)
    iface = TowerInterface.from_json(artifact.meta["interface"])
    meta = {**artifact.meta, "precision": "int8", "calibration_cache": layout.CALIBRATION}
    if ctx.dry_run:
        return Artifact("onnx-encoder", ctx.workdir, meta)
    layout.carry(artifact.path, ctx.workdir, layout.ONNX_DIR, layout.ASSETS, encoder_parity.SAMPLES_FILE)
    feeds, origin, count = calibration_feeds(iface, opts, artifact.path / layout.ASSETS, ctx)
    import numpy as np
    from onnxruntime.quantization import CalibrationMethod, create_calibrator

    work = ctx.workdir / "calibration"
    work.mkdir()
    calibrator = create_calibrator(str(layout.onnx_path(ctx.workdir)), None,
                                   augmented_model_path=str(work / "augmented.onnx"),
                                   calibrate_method=CalibrationMethod.Entropy,
                                   extra_options={"symmetric": True})
    calibrator.collect_data(_Reader(feeds))
    ranges = {name: float(max(abs(float(np.max(d.range_value[0]))), abs(float(np.max(d.range_value[1])))))
              for name, d in calibrator.compute_data().data.items()}
    for tensor in iface.inputs:  # float graph inputs need ranges too (ids are not quantized)
        if tensor.dtype.startswith("FP"):
            ranges[tensor.name] = float(max(np.abs(f[tensor.name]).max() for f in feeds))
    _remove(work)
    write_trt_cache(ctx.workdir / layout.CALIBRATION, ranges, opts.trt_version)
    recipe = {"quant": "int8", "mode": "tensorrt implicit int8 (calibration cache)",
              "calibration": origin, "calibration_samples": count, "method": "entropy (onnxruntime)",
              "tensors": len(ranges), "header": trt_cache_header(opts.trt_version),
              "parity": "measured where TensorRT runs the plan; not on this machine"}
    meta["quantization"] = recipe
    ctx.note("quantization", recipe)
    return Artifact("onnx-encoder", ctx.workdir, meta)
