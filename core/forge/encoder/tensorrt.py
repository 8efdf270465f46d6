"""Compile stage of the tensorrt target: ``trtexec`` turns the ONNX graph into ``model.plan``.

The optimisation profile comes from the build: batch 1…``--max-batch-size``, sequence 1…the tower's
max length (opt: the full length when texts are padded to it, else ``-o opt_seq_len``, default 128).
"""

from __future__ import annotations

from pathlib import Path

from ..components import Artifact, Component
from ..context import BuildContext
from . import layout, encoder_parity
from .adapter import TEXT, TowerInterface
from .encoder_options import EncoderOptions
from .input_models import text_padding


def shapes(iface: TowerInterface, opts: EncoderOptions, max_batch: int) -> dict[str, str]:
    """trtexec's --minShapes/--optShapes/--maxShapes values for the tower's inputs."""
    max_len = int(iface.preprocessing.get("max_length", 1))
    if iface.modality == TEXT and text_padding(iface, opts) == "max_length":
        opt_len = max_len
    else:
        opt_len = min(opts.opt_seq_len or 128, max_len)
    opt_batch = min(opts.opt_batch_size or max_batch, max_batch)
    profile = {"min": (1, 1), "opt": (opt_batch, opt_len), "max": (max_batch, max_len)}
    result = {}
    for kind, (batch, length) in profile.items():
        result[kind] = ",".join(
            f"{t.name}:" + "x".join(str(d) for d in (batch, *[length if d == -1 else d for d in t.dims]))
            for t in iface.inputs)
    return result


def command(onnx: Path, plan: Path, iface: TowerInterface, opts: EncoderOptions, ctx: BuildContext,
            calibration: Path | None) -> list[str]:
    """The full trtexec command line for one tower."""
    profile = shapes(iface, opts, ctx.spec.limits.max_batch_size)
    argv = ["trtexec", f"--onnx={onnx}", f"--saveEngine={plan}",
            f"--minShapes={profile['min']}", f"--optShapes={profile['opt']}", f"--maxShapes={profile['max']}",
            f"--memPoolSize=workspace:{opts.workspace_mib}", f"--timingCacheFile={opts.timing_cache}",
            "--skipInference"]
    if ctx.spec.dtype == "float16":
        argv.append("--fp16")
    if calibration is not None:
        argv += ["--int8", f"--calib={calibration}"]
    return argv


def compile(component: Component, artifact: Artifact, ctx: BuildContext) -> Artifact:
    """Run (or, under --dry-run, only record) trtexec; the artifact holds model.plan and the assets."""
    opts = EncoderOptions.read(ctx)
    iface = TowerInterface.from_json(artifact.meta["interface"])
    calibration = artifact.path / layout.CALIBRATION if artifact.meta.get("calibration_cache") else None
    plan = ctx.workdir / layout.PLAN
    argv = command(layout.onnx_path(artifact.path), plan, iface, opts, ctx, calibration)
    if not ctx.dry_run:
        opts.timing_cache.parent.mkdir(parents=True, exist_ok=True)
    ctx.note("tensorrt", {"profile": shapes(iface, opts, ctx.spec.limits.max_batch_size),
                          "precision": ("int8+" if calibration else "") + ctx.spec.dtype})
    ctx.run_tool(argv, purpose=f"--target tensorrt (TensorRT plan of {component.name})")
    if not ctx.dry_run:
        layout.carry(artifact.path, ctx.workdir, layout.ASSETS, encoder_parity.SAMPLES_FILE)
    return Artifact("tensorrt-plan", ctx.workdir, {**artifact.meta, "plan": layout.PLAN})
