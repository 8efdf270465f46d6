"""Export stage: the torch tower → ONNX with dynamic axes, checked against torch on sample inputs."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from ..components import Artifact, Component
from ..context import BuildContext
from ..errors import ForgeError
from . import layout, encoder_parity, samples
from .adapter import TEXT, EncoderAdapter, TowerInterface
from .encoder_options import EncoderOptions
from .input_models import image_preprocessor, text_tokenizer

EXPORTER = "torch.onnx TorchScript exporter"
OPSET_REASON = "default 17: native LayerNormalization; parsed by TensorRT >= 8.6 and every current ONNX Runtime"


def export(adapter: EncoderAdapter, component: Component, ctx: BuildContext) -> Artifact:
    """Write ``onnx/model.onnx``, the preprocessing assets and the parity samples of one tower."""
    adapter.tower(component.role)
    opts = EncoderOptions.read(ctx)
    source = adapter.open_source(component.source, ctx)
    iface = source.interface(component.role)
    meta: dict[str, Any] = {"interface": iface.to_json(), "source_format": source.kind,
                            "precision": "float32", "opset": opts.opset}
    ctx.note("interface", {"source_format": source.kind, "inputs": [t.to_json() for t in iface.inputs],
                           "output": iface.output.to_json(), **dict(iface.notes)})
    if ctx.dry_run:
        return Artifact("onnx-encoder", ctx.workdir, meta)

    import torch

    assets = ctx.workdir / layout.ASSETS
    assets.mkdir(parents=True)
    source.write_assets(component.role, assets)
    feeds = sample_inputs(iface, opts, assets)
    if iface.modality == TEXT:
        check_tokenizer(source, iface, opts, assets, ctx)
    torch.manual_seed(0)
    module = exportable(source.load(component.role), iface).eval()
    onnx_file = layout.onnx_path(ctx.workdir)
    ctx.note("export", export_onnx(module, iface, feeds[0], onnx_file, opts.opset))

    with torch.inference_mode():
        reference = [module(*[torch.from_numpy(f[t.name]) for t in iface.inputs]).numpy() for f in feeds]
    stats = encoder_parity.measure(reference, encoder_parity.onnxruntime_outputs(onnx_file, feeds))
    tolerance = opts.parity_tolerance or adapter.tolerance["float32"]
    ctx.note("parity", {**stats, "tolerance": tolerance, "precision": "float32",
                        "against": "torch float32", "runtime": "onnxruntime CPUExecutionProvider"})
    encoder_parity.save(ctx.workdir / encoder_parity.SAMPLES_FILE, feeds, reference)
    encoder_parity.check(stats, tolerance, f"{component.name}: ONNX export parity",
                 "raise it with --parity-tolerance if the difference is expected")
    return Artifact("onnx-encoder", ctx.workdir, meta)


def sample_inputs(iface: TowerInterface, opts: EncoderOptions, assets: Path) -> list[dict[str, Any]]:
    """Parity batches prepared by the served preprocessing code; the first one is traced."""
    if iface.modality == TEXT:
        tokenize = text_tokenizer(iface, opts, assets)
        texts = list(samples.PARITY_TEXTS)
        batches = [texts[1:3], texts, texts[1:2]]
        return [tokenize(batch) for batch in batches]
    preprocess = image_preprocessor(iface)
    return [{iface.inputs[0].name: preprocess.batch(batch)} for batch in samples.parity_images()]


def check_tokenizer(source, iface: TowerInterface, opts: EncoderOptions, assets: Path, ctx: BuildContext) -> None:
    """The served tokenizer must give the ids the model's own tokenizer gives (before padding)."""
    texts = list(samples.PARITY_TEXTS)
    served = text_tokenizer(iface, opts, assets)(texts)
    lengths = served["attention_mask"].sum(axis=1) if "attention_mask" in served else None
    expected = source.reference_tokens(iface.role, texts)
    mismatched = []
    for row, ids in enumerate(expected):
        got = served["input_ids"][row][: lengths[row] if lengths is not None else len(ids)].tolist()
        if got != list(ids):
            mismatched.append(row)
    ctx.note("tokenizer_parity", {"texts": len(texts), "identical": not mismatched,
                                  "reference": type(source).__name__})
    if mismatched:
        raise ForgeError(f"the served tokenizer disagrees with the model's tokenizer on {texts[mismatched[0]][:60]!r}",
                         hint="the checkpoint's tokenizer.json and its tokenizer config may not match")


def exportable(module, iface: TowerInterface):
    """Wrap a tower so INT32 inputs are cast to int64 inside the graph (TensorRT 8 has no int64 I/O)."""
    import torch

    casts = [t.dtype == "INT32" for t in iface.inputs]

    class Exportable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = module

        def forward(self, *inputs):
            inputs = [x.long() if cast else x for x, cast in zip(inputs, casts)]
            return self.tower(*inputs).float()

    return Exportable()


def dynamic_axes(iface: TowerInterface) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for tensor in (*iface.inputs, iface.output):
        axes[tensor.name] = {0: "batch"}
        for index, (dim, name) in enumerate(zip(tensor.dims, tensor.axes or ("",) * len(tensor.dims))):
            if dim == -1:
                axes[tensor.name][index + 1] = name or f"{tensor.name}_{index + 1}"
    return axes


def export_onnx(module, iface: TowerInterface, feeds: dict[str, Any], path: Path, opset: int) -> dict[str, Any]:
    """Trace ``module`` on ``feeds`` and write ``path``; returns what the manifest records."""
    import warnings

    import onnx
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    args = tuple(torch.from_numpy(feeds[t.name]) for t in iface.inputs)
    axes = dynamic_axes(iface)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    # nn.MultiheadAttention's inference fast path (open_clip) traces to an op ONNX does not have.
    torch.backends.mha.set_fastpath_enabled(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about python branches on shapes
        try:
            # The TorchScript exporter: mature for BERT/CLIP with dynamic_axes and needs no onnxscript.
            torch.onnx.export(module, args, str(path), input_names=[t.name for t in iface.inputs],
                              output_names=[iface.output.name], dynamic_axes=axes, opset_version=opset,
                              do_constant_folding=True, dynamo=False)
        except Exception as exc:  # the exporter raises many types; all mean "this graph did not export"
            raise ForgeError(f"ONNX export of the {iface.role} tower failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:300]}", hint="try another -o opset=N") from exc
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)
    onnx.checker.check_model(str(path))
    graph = onnx.load(str(path), load_external_data=False).graph
    ops = collections.Counter(node.op_type for node in graph.node)
    return {
        "exporter": EXPORTER, "torch": torch.__version__, "onnx": onnx.__version__, "opset": opset,
        "opset_reason": OPSET_REASON if opset == 17 else "chosen with -o opset",
        "changes": ["constant folding (do_constant_folding=True)",
                    "INT32 inputs cast to int64 inside the graph",
                    "the tower's pooling, projection and configured L2 normalisation traced into the graph"],
        "dynamic_axes": {k: {str(i): n for i, n in v.items()} for k, v in axes.items()},
        "nodes": len(graph.node), "initializers": len(graph.initializer),
        "top_ops": dict(ops.most_common(8)), "checker": "passed",
        "bytes": sum(p.stat().st_size for p in path.parent.iterdir()),
    }
