"""Serving benchmark: forge's --target python decoder vs. a per-request HF pipeline model, same tritonserver.

(a) forge: ``forge build --target python`` (continuous batching behind the tensorrt_llm interface),
    asked through its ensemble (text in, text out);
(b) reference: ``benchmarks/reference/model.py``, a python-backend model running the Hugging Face
    ``text-generation`` pipeline per request (``text_input`` + ``max_tokens`` → ``text_output``).
Both are greedy, so they generate the same tokens for the same (chat-templated) prompt; both run in
one real tritonserver with the same CPU threads. Closed-loop load at concurrency 1 and 8, 32 new tokens;
output tokens are counted with the model's tokenizer. Prints req/s, tokens/s, p50/p99 latency.

    python benchmarks/serve_decoder.py [--model smollm2|HF_DIR] [--requests 32] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
    "Give me three tips for learning a new language.",
    "Describe the city of Paris to someone who has never been there.",
    "What are the main causes of the seasons on Earth?",
    "Write a poem about the ocean at night.",
    "How does a bicycle stay upright while moving?",
    "List some healthy breakfast ideas and explain why they are healthy.",
]


def reference_model(repo: Path, model_dir: Path, max_batch_size: int, threads: int, dtype: str) -> None:
    """Write the reference model into ``repo/reference`` (config as protobuf, like every forge config)."""
    from forge import tritonconfig as tc
    from forge.components import TritonModel
    from forge.repository import write_model

    config = tc.model_config(
        "reference", backend="python", max_batch_size=max_batch_size,
        inputs=[tc.model_input("text_input", "STRING", [1]), tc.model_input("max_tokens", "INT32", [1])],
        outputs=[tc.model_output("text_output", "STRING", [1])],
        parameters={"model_dir": str(model_dir.resolve()), "cpu_threads": threads, "dtype": dtype},
        instances=1, dynamic_batching=True)
    write_model(TritonModel(config, {"1/model.py": (HERE / "reference" / "model.py").read_bytes()}), repo)


def build_forge(model_dir: Path, out: Path, max_batch_size: int, family: str, dtype: str) -> None:
    from forge.cli import main

    argv = ["build", "--family", family, "--model", str(model_dir), "--target", "python", "--dtype", dtype,
            "--max-batch-size", str(max_batch_size), "-o", "exclude_input_in_output=true", "--out", str(out)]
    if main(argv) != 0:
        sys.exit("benchmark: forge build failed")


def family_of(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    return "gpt" if config.get("model_type") == "gpt2" else "llama"


def chat(tokenizer, question: str) -> str:
    """The question as an instruct model expects it (its chat template), when it has one."""
    if not getattr(tokenizer, "chat_template", None):
        return question
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def measure(url: str, model: str, tokenizer, concurrency: int, requests: int, max_tokens: int) -> dict:
    from forge.serving import bench
    from forge.serving.client import GrpcSession

    with GrpcSession(url) as session:
        inputs = session.config(model)
    target = bench.Target(inputs, stream=False,
                          count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    items = bench.prompts([chat(tokenizer, p) for p in PROMPTS], requests, max_tokens)
    bench.run(url, target, items[:2], concurrency=1)  # warm-up, not measured
    samples, wall = bench.run(url, target, items, concurrency=concurrency)
    return bench.summarize(samples, wall)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (the real SmolLM2-135M-Instruct) or an HF dir")
    parser.add_argument("--requests", type=int, default=32, help="requests per run at concurrency 8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per model (default 1: on a small shared machine more threads than "
                             "free cores make OpenMP spin; 0: torch's default)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype of both models (bfloat16 uses the CPU's bf16 matmuls)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from forge.serving.bench import format_table
    from forge.serving.server import TritonServer

    if args.model == "smollm2":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
        import smollm2

        model_dir, label = smollm2.hf_dir(), "SmolLM2-135M-Instruct"
    else:
        model_dir, label = Path(args.model), Path(args.model).name
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if args.threads:
        os.environ["FORGE_PYTARGET_THREADS"] = str(args.threads)
    # Idle OpenMP threads yield the CPU instead of spinning (both models run in the same server).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rows = []
    with tempfile.TemporaryDirectory(prefix="forge-serve-bench-") as scratch:
        built = Path(scratch) / "forge"
        build_forge(model_dir, built, 8, family_of(model_dir), args.dtype)
        repo = Path(scratch) / "repo"
        shutil.copytree(built, repo, ignore=shutil.ignore_patterns("forge-manifest.json"))
        reference_model(repo, model_dir, 8, args.threads, args.dtype)
        with TritonServer(repo, startup_timeout=900) as server:
            for name, model in (("forge python target", "ensemble"), ("reference (HF pipeline)", "reference")):
                for concurrency in (1, 8):
                    count = max(4, args.requests // 4) if concurrency == 1 else args.requests
                    started = time.perf_counter()
                    summary = measure(server.grpc_url, model, tokenizer, concurrency, count, args.max_tokens)
                    summary.update({"server": name, "concurrency": concurrency,
                                    "run": f"{name}, c={concurrency}"})
                    rows.append(summary)
                    print(f"  {summary['run']}: {summary['req_per_s']:.2f} req/s "
                          f"({time.perf_counter() - started:.0f}s)", flush=True)
    by = {(r["server"], r["concurrency"]): r for r in rows}
    speedup = by[("forge python target", 8)]["req_per_s"] / max(by[("reference (HF pipeline)", 8)]["req_per_s"], 1e-9)
    print()
    print(f"{label} ({args.dtype}), {args.max_tokens} new tokens, greedy, CPU threads per model: "
          f"{args.threads or torch.get_num_threads()} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores)")
    print(format_table(rows, label="run"))
    print(f"forge / reference req/s at concurrency 8: {speedup:.1f}x (target ≥ 4x)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": label, "dtype": args.dtype, "max_tokens": args.max_tokens,
                                             "rows": rows,
                                             "speedup_c8": speedup}, indent=2))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
