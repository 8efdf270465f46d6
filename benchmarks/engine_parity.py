"""The python target's engine on whatever device is present: parity with transformers, batched throughput.

Loads the runtime exactly as Triton does (the ``runtime`` folder imported as the standalone package
``forge_decoder``, without forge itself), builds a small random Llama or the given HF directory, and
1. checks that greedy continuations of prompts of different lengths, generated together with
   sequences joining mid-flight, equal transformers' ``generate`` one prompt at a time;
2. times decoding steps at batch 1 and batch 8 against ``generate`` run once per prompt.

    python benchmarks/engine_parity.py [--model HF_DIR] [--device cuda|cpu] [--dtype float16]
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "core" / "forge" / "in_triton" / "python_target" / "forge_decoder"


def runtime():
    """Import the runtime as the model directory holds it: package ``forge_decoder``."""
    root = Path(tempfile.mkdtemp(prefix="forge-runtime-"))
    shutil.copytree(RUNTIME, root / "forge_decoder", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(root))
    return (importlib.import_module("forge_decoder.engine"), importlib.import_module("forge_decoder.request"),
            importlib.import_module("forge_decoder.sequences"))


def random_llama(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                                         num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                         max_position_embeddings=512))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF directory (default: a random 4-layer Llama)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    import torch

    engine_mod, request_mod, sequences_mod = runtime()
    model_dir = args.model or random_llama(Path(tempfile.mkdtemp(prefix="forge-llama-")))
    device = engine_mod.choose_device(args.device)
    dtype = engine_mod.choose_dtype(device, args.dtype)
    model = engine_mod.load_model(model_dir, device, dtype)
    model.generation_config.eos_token_id = None
    vocab = int(model.get_output_embeddings().weight.shape[0])
    limits = request_mod.Limits(vocab, 256, 512)
    print(f"{type(model).__name__} on {device} ({dtype}), torch {torch.__version__}")

    def hf(prompt, n):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        return out[0, len(prompt):].tolist()

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (5, 31, 12, 64, 1, 20, 47, 9)]
    lengths = [args.new_tokens - 7 * (i % 3) for i in range(len(prompts))]
    results = {}

    def collect(seq, update):
        if update.finished:
            results[id(seq)] = list(seq.output)

    engine = engine_mod.Engine(model, limits, max_rows=4)
    seqs = [sequences_mod.Sequence(request_mod.GenerationRequest(p, n), collect) for p, n in zip(prompts, lengths)]
    engine.submit(seqs[:5])
    with torch.inference_mode():
        for _ in range(3):
            engine.step()
    engine.submit(seqs[5:])
    engine.run_until_idle()
    same = sum(results[id(s)] == hf(p, n) for s, p, n in zip(seqs, prompts, lengths))
    print(f"parity: {same}/{len(seqs)} continuations equal transformers' greedy generate")

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    n = args.new_tokens
    hf_total = timed(lambda: [hf(p, n) for p in prompts])
    for rows in (1, 8):
        batch = engine_mod.Engine(model, limits, max_rows=rows)
        batch.submit([sequences_mod.Sequence(request_mod.GenerationRequest(p, n), lambda s, u: None) for p in prompts])
        with torch.inference_mode():
            took = timed(batch.run_until_idle)
        print(f"engine, {rows} in flight: {len(prompts) * n / took:8.1f} tokens/s "
              f"({hf_total / took:.1f}x transformers generate one prompt at a time: "
              f"{len(prompts) * n / hf_total:.1f} tokens/s)")
    return 0 if same == len(seqs) else 1


if __name__ == "__main__":
    sys.exit(main())
