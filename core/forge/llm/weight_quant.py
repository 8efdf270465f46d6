"""The quantize stage of the decoder families.

``w8a16`` / ``w4a16`` are declared in the checkpoint's ``quantization`` block: TensorRT-LLM
quantizes those weights itself when it loads the float checkpoint. ``int4_awq``, ``fp8`` and
``int8_kv`` need activation statistics, so the Hugging Face model is calibrated with
nvidia-modelopt (on CPU for small models) on a text sample and exported through modelopt's
TensorRT-LLM checkpoint writer. The recipe is recorded in the manifest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from forge.components import Artifact
from forge.errors import ForgeError, ToolMissingError, UsageError

from . import loadercheck, quantlayout
from .adapter import DecoderAdapter
from .checkpoint import ARTIFACT_KIND

DECLARED = {"w8a16": "W8A16", "w4a16": "W4A16"}  # TensorRT-LLM quantizes these at build time
CALIBRATED = {"int4_awq": "W4A16_AWQ", "fp8": "FP8"}  # need modelopt calibration
KV_CACHE = {"int8_kv": "INT8"}
AWQ_GROUP_SIZES = (128, 64, 32, 16)  # preferred first; 128 is TensorRT-LLM's default

#: Built-in calibration sample: varied prose, code and dialogue so activations cover common ranges.
CALIBRATION_TEXT = (
    "The capital of France is Paris, a city on the Seine known for its museums and cafés.",
    "Machine learning is a field of study that gives computers the ability to learn without explicit programming.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "User: How do I reset my password?\nAssistant: Open Settings, choose Account, then select Reset password.",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen as a by-product.",
    "In 1969 the Apollo 11 mission landed the first humans on the Moon; Neil Armstrong stepped out first.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10 ORDER BY 2 DESC;",
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on high mountains.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.",
    "The derivative of sin(x) is cos(x), and the integral of 1/x is the natural logarithm of |x|.",
    "Please summarize the following report in three bullet points for the executive team.",
    "Tokyo, Delhi, Shanghai, São Paulo and Mexico City are among the most populous cities in the world.",
    "A healthy breakfast might include oatmeal with berries, yogurt, nuts and a cup of green tea.",
    "GPUs execute thousands of threads in parallel, which makes them well suited to matrix multiplication.",
    "She opened the letter slowly, unsure whether the news inside would be good or bad.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\nprint(x.mean(), x.std())",
    "The mitochondria is the powerhouse of the cell, producing ATP through oxidative phosphorylation.",
    "Translate to German: The weather is beautiful today and we are going to the park.",
    "Interest rates rose by a quarter point as the central bank tried to slow inflation.",
    "To install the package, run pip install followed by the package name in your terminal.",
    "Shakespeare wrote Hamlet, Macbeth, Othello and King Lear, among many other plays and sonnets.",
    "The recipe calls for two cups of flour, one teaspoon of salt and three eggs, mixed well.",
    "Q: What is 17 times 23? A: 17 times 23 is 391.",
)


@dataclass
class Recipe:
    """What the quantize stage does: algorithms, AWQ group size and the calibration set."""

    modes: tuple[str, ...]
    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int | None = None
    calibrate: bool = False
    calibration: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def quantization(self) -> dict[str, Any]:
        """The ``quantization`` block of the TensorRT-LLM config."""
        block: dict[str, Any] = {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo}
        if self.group_size:
            block["group_size"] = self.group_size
        return block


def awq_widths(meta: Mapping[str, Any]) -> dict[str, int]:
    """Per-rank input width of every layer AWQ quantizes (the block size must divide each)."""
    tp = meta["tp"]
    q_dim = meta["num_heads"] * meta["head_size"]
    return {"attention.qkv / mlp.fc (hidden_size)": meta["hidden_size"],
            f"attention.dense (heads·head_size/tp = {q_dim}/{tp})": q_dim // tp,
            f"mlp.proj (intermediate_size/tp = {meta['intermediate_size']}/{tp})": meta["intermediate_size"] // tp}


def awq_group_size(meta: Mapping[str, Any], requested: Any) -> tuple[int, str | None]:
    """The AWQ block size: the requested one if every quantized width allows it, else a clear error.

    A block must divide every per-rank input width (modelopt packs whole blocks per rank) and keep
    every width a multiple of max(64, block)·tp (TensorRT-LLM pads other widths and would not load them).
    """
    widths = awq_widths(meta)
    divides = [g for g in AWQ_GROUP_SIZES if all(w % g == 0 for w in widths.values())]
    fitting = [g for g in divides if not quantlayout.unpadded(meta, "W4A16_AWQ", g)]
    if requested is None:
        if not divides:
            raise UsageError(f"no INT4-AWQ block size in {AWQ_GROUP_SIZES} divides every quantized layer's "
                             f"per-rank input width ({', '.join(f'{k}: {v}' for k, v in widths.items())})")
        if not fitting:
            quantlayout.check_widths(meta, ("int4_awq",), "W4A16_AWQ", divides[-1])
        note = None
        if fitting[0] != AWQ_GROUP_SIZES[0]:
            bad = next((k for k, w in widths.items() if w % AWQ_GROUP_SIZES[0]), None)
            why = (f"does not divide {bad} = {widths[bad]}" if bad else "would be padded by TensorRT-LLM ("
                   + quantlayout.unpadded(meta, "W4A16_AWQ", AWQ_GROUP_SIZES[0])[0] + ")")
            note = f"AWQ block size {fitting[0]} chosen: the default {AWQ_GROUP_SIZES[0]} {why}"
        return fitting[0], note
    try:
        group = int(requested)
    except (TypeError, ValueError):
        raise UsageError(f"--group-size must be an integer, got {requested!r}") from None
    if group < 1:
        raise UsageError(f"--group-size must be positive, got {group}")
    for name, width in widths.items():
        if width % group:
            hint = (f"use --group-size {fitting[0]}" if fitting else "choose a block size that divides every width"
                    if not divides else "no block size fits: TensorRT-LLM pads INT4-AWQ layers to multiples of "
                    "max(64, block)·tp; use --quant fp8 or int8_kv")
            raise UsageError(f"INT4-AWQ block size {group} does not divide the per-rank input width of {name} "
                             f"= {width}; modelopt packs whole blocks per rank", hint=hint)
    quantlayout.check_widths(meta, ("int4_awq",), "W4A16_AWQ", group)
    return group, None


def make_recipe(modes: Sequence[str], meta: Mapping[str, Any], options: Mapping[str, Any]) -> Recipe:
    """Check that the requested modes combine and turn them into a recipe."""
    modes = tuple(dict.fromkeys(modes))
    known = (*DECLARED, *CALIBRATED, *KV_CACHE)
    for mode in modes:
        if mode not in known:
            raise UsageError(f"unknown --quant {mode!r} for decoders; choose from {', '.join(known)}")
    weight_modes = [m for m in modes if m in DECLARED or m in CALIBRATED]
    if len(weight_modes) > 1:
        raise UsageError(f"--quant {' and '.join(weight_modes)} both quantize the weights; pick one "
                         "(int8_kv may be added to any of them)")
    recipe = Recipe(modes)
    weight = weight_modes[0] if weight_modes else None
    if weight:
        recipe.quant_algo = DECLARED.get(weight) or CALIBRATED[weight]
    if "int8_kv" in modes:
        recipe.kv_cache_quant_algo = KV_CACHE["int8_kv"]
    recipe.calibrate = weight in CALIBRATED or recipe.kv_cache_quant_algo is not None
    if weight == "int4_awq":
        recipe.group_size, note = awq_group_size(meta, options.get("group_size"))
        if note:
            recipe.notes.append(note)
    elif options.get("group_size") is not None:
        recipe.notes.append(f"--group-size ignored: only int4_awq is group-wise (asked for {', '.join(modes)})")
    if weight in DECLARED:
        quantlayout.check_widths(meta, modes, recipe.quant_algo)
    if recipe.calibrate:
        quantlayout.check_pipeline(meta, modes)
        recipe.calibration = {"data": str(options["calib_data"]) if options.get("calib_data") else "built-in sample",
                              "samples": int(options.get("calib_size", 64)),
                              "max_tokens": int(options.get("calib_seq_len", 256))}
    return recipe


def calibration_texts(path: Any, limit: int) -> list[str]:
    """Calibration samples: one per non-empty line of ``path``, or the built-in sample."""
    if not path:
        return list(CALIBRATION_TEXT)[:limit]
    file = Path(path)
    try:
        lines = [line.strip() for line in file.read_text(errors="replace").splitlines()]
    except OSError as exc:
        raise UsageError(f"cannot read --calib-data {file}: {exc.strerror or exc}") from None
    texts = [line for line in lines if line]
    if not texts:
        raise UsageError(f"--calib-data {file} has no text (one calibration sample per line)")
    return texts[:limit]


# -- nvidia-modelopt ------------------------------------------------------------------------------

def _modelopt():
    try:
        import modelopt.torch.export as mte
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise ToolMissingError(f"nvidia-modelopt is not installed ({exc.name}); int4_awq, fp8 and int8_kv "
                               "calibration need it", hint="pip install 'forge-triton[quant]', or use "
                               "--quant w8a16 / w4a16, which TensorRT-LLM applies without calibration") from None
    return mtq, mte


def modelopt_config(recipe: Recipe, mtq) -> dict[str, Any]:
    """The modelopt quantization config of a recipe (list-style ``quant_cfg`` or the older dict style)."""
    import copy

    if recipe.quant_algo == "W4A16_AWQ":
        config = copy.deepcopy(mtq.INT4_AWQ_CFG)
    elif recipe.quant_algo == "FP8":
        config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    else:  # KV-cache only: weights stay float (a declared weight-only algorithm is added afterwards)
        config = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    quant_cfg = config["quant_cfg"]
    kv = {"num_bits": 8, "axis": None}
    if isinstance(quant_cfg, dict):  # modelopt < 0.40
        if recipe.group_size:
            quant_cfg["*weight_quantizer"]["block_sizes"] = {-1: recipe.group_size, "type": "static"}
        if recipe.kv_cache_quant_algo:
            quant_cfg["*[kv]_bmm_quantizer"] = {**kv, "enable": True}
        return config
    for entry in quant_cfg:
        if recipe.group_size and entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
            entry["cfg"]["block_sizes"] = {-1: recipe.group_size, "type": "static"}
    if recipe.kv_cache_quant_algo:
        quant_cfg.append({"quantizer_name": "*[kv]_bmm_quantizer", "cfg": kv})
    return config


def load_for_calibration(source: Path, spec):
    """The Hugging Face model (float32, CPU) and tokenizer that calibration runs."""
    import torch
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=spec.trust_remote_code)
    except Exception as exc:  # transformers raises many types for "no tokenizer here"
        raise UsageError(f"calibration needs the checkpoint's tokenizer, but {source} has none usable "
                         f"({type(exc).__name__})",
                         hint="add the tokenizer files, or use --quant w8a16 / w4a16") from None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, trust_remote_code=spec.trust_remote_code,
        use_safetensors=not spec.allow_pickle)
    return model.eval(), tokenizer


def calibrate(model, tokenizer, recipe: Recipe, texts: Sequence[str]):
    """Run modelopt's calibration on ``model`` in place and return it (fake-quantized)."""
    import torch

    mtq, _ = _modelopt()
    max_tokens = recipe.calibration.get("max_tokens", 256)
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if positions:  # learned position tables (GPT-2) have no rows past their length
        max_tokens = min(max_tokens, positions)
    batches = [tokenizer(t, return_tensors="pt", truncation=True, max_length=max_tokens).input_ids for t in texts]
    batches = [b for b in batches if b.shape[-1] > 0]

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(ids)

    return mtq.quantize(model, modelopt_config(recipe, mtq), forward_loop)


def export_modelopt(adapter: DecoderAdapter, model, out: Path, dtype: str, tp: int, pp: int) -> dict[str, Any]:
    """Write modelopt's TensorRT-LLM checkpoint of a calibrated model; return its config."""
    import torch

    _, mte = _modelopt()
    mte.export_tensorrt_llm_checkpoint(model, adapter.modelopt_decoder, dtype=getattr(torch, dtype),
                                       export_dir=str(out), inference_tensor_parallel=tp,
                                       inference_pipeline_parallel=pp)
    config_file = out / "config.json"
    missing = [f"rank{r}.safetensors" for r in range(tp * pp) if not (out / f"rank{r}.safetensors").is_file()]
    if not config_file.is_file() or missing:
        raise ForgeError(f"modelopt's export left {out} incomplete (missing {', '.join(missing) or 'config.json'})")
    return json.loads(config_file.read_text())


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # rank files are immutable once written: share them with the export stage
    except OSError:
        shutil.copy2(src, dst)


def quantize(adapter: DecoderAdapter, source: Path, artifact: Artifact, ctx) -> Artifact | None:
    """The quantize stage: a new checkpoint in ``ctx.workdir/checkpoint`` with the recipe applied."""
    spec = ctx.spec
    meta = dict(artifact.meta)
    recipe = make_recipe(spec.quant, meta, spec.options)
    for note in recipe.notes:
        ctx.log(note)
    ctx.note("quantize", asdict(recipe))
    if ctx.dry_run:
        return None
    out = ctx.workdir / "checkpoint"
    out.mkdir(parents=True)
    modelopt_version = None
    if recipe.calibrate:
        texts = calibration_texts(spec.options.get("calib_data"), recipe.calibration["samples"])
        recipe.calibration["samples"] = len(texts)
        ctx.log(f"calibrating with nvidia-modelopt on {len(texts)} samples ({', '.join(recipe.modes)})")
        with contextlib.redirect_stdout(sys.stderr):  # modelopt prints progress; stdout is for --json
            model, tokenizer = load_for_calibration(Path(source), spec)
            calibrate(model, tokenizer, recipe, texts)
            written = export_modelopt(adapter, model, out, spec.dtype, spec.tp, spec.pp)
        del model
        quantization = dict(written.get("quantization") or {})
        if recipe.quant_algo in DECLARED.values():  # KV scales from modelopt, weights quantized at build time
            quantization["quant_algo"] = recipe.quant_algo
        got = (quantization.get("quant_algo"), quantization.get("kv_cache_quant_algo"))
        if got != (recipe.quant_algo, recipe.kv_cache_quant_algo):
            raise ForgeError(f"modelopt exported {got[0]} weights / {got[1]} KV cache, but the recipe asked for "
                             f"{recipe.quant_algo} / {recipe.kv_cache_quant_algo}")
        modelopt_version = (written.get("producer") or {}).get("version")
        # forge's own config (position embedding, activation, RoPE settings) with modelopt's quantization
        config = quantlayout.merged_config(json.loads((artifact.path / "config.json").read_text()),
                                           {**written, "quantization": quantization})
        config["producer"] = {**config.get("producer", {}), "quantized_by": f"nvidia-modelopt {modelopt_version}"}
        quantlayout.check_tensors(artifact.path, out, config, f"nvidia-modelopt {modelopt_version}")
        meta["vocab_size_padded"] = config.get("vocab_size", meta.get("vocab_size_padded"))
    else:
        config = json.loads((artifact.path / "config.json").read_text())
        config["quantization"] = recipe.quantization()
        for r in range(meta["world_size"]):
            _link_or_copy(artifact.path / f"rank{r}.safetensors", out / f"rank{r}.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta["quant"] = {**recipe.quantization(), "modes": list(recipe.modes),
                     "method": "nvidia-modelopt" if recipe.calibrate else "declared (quantized by trtllm-build)",
                     **({"calibration": recipe.calibration, "modelopt": modelopt_version} if recipe.calibrate else {})}
    ctx.note("quantize", {**asdict(recipe), "method": meta["quant"]["method"]})
    if ctx.target == "tensorrtllm":
        loadercheck.check_checkpoint(ctx, out)
    return Artifact(ARTIFACT_KIND, out, meta)
