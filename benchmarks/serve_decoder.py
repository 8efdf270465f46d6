"""Serving benchmark: forge's DEFAULT python-target build vs seed 000's model, one run on one server.

(a) forge default: ``forge build --family F --model M --target python`` (no other flag: whatever dtype
    and threads the default chooses on this machine), asked through its ensemble;
(b) seed 000's model as that recipe writes it: ``forge build --target hf-pipeline`` (the Hugging Face
    ``text-generation`` pipeline per request, float16, torch's default threads, max_batch_size 0,
    one instance), under the name prefix ``seed_``.
Both are greedy and get the same chat-templated prompts; both run in one real tritonserver; no
environment variable is set. Closed-loop load at concurrency 1 and 8, 32 new tokens; generated tokens
are counted with the model's tokenizer in the text each returns (requests ask for the generated text
only: ``exclude_input_in_output``, an input both models honour). Prints both configurations,
req/s, generated tokens/s, p50/p99 latency and the tokens/s ratio at concurrency 8 (goal ≥ 4×).

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
SEED = "seed_"  # name prefix of the hf-pipeline build


def build(model_dir: Path, out: Path, family: str, *extra: str) -> dict:
    """``forge build`` with only the arguments a user types; the manifest's record of the served model."""
    from forge.cli import main

    argv = ["build", "--family", family, "--model", str(model_dir), "--out", str(out), *extra]
    print("$ forge " + " ".join(argv), flush=True)
    if main(argv) != 0:
        sys.exit("benchmark: forge build failed")
    return json.loads((out / "forge-manifest.json").read_text())


def find_note(manifest, key: str) -> dict:
    """The first ``notes[key]`` anywhere in a manifest (the stage records of its components)."""
    if isinstance(manifest, dict):
        if isinstance(manifest.get("notes"), dict) and key in manifest["notes"]:
            return manifest["notes"][key]
        values = manifest.values()
    elif isinstance(manifest, list):
        values = manifest
    else:
        return {}
    for value in values:
        found = find_note(value, key)
        if found:
            return found
    return {}


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
    # Both models return only the generated text when asked (a request input, not a build flag), so the
    # count is exact: no echoed chat-templated prompt to strip.
    target = bench.Target(inputs, stream=False, extra={"exclude_input_in_output": True},
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
    rows = []
    with tempfile.TemporaryDirectory(prefix="forge-serve-bench-") as scratch:
        family = family_of(model_dir)
        default = build(model_dir, Path(scratch) / "default", family, "--target", "python")
        build(model_dir, Path(scratch) / "seed", family, "--target", "hf-pipeline", "--name-prefix", SEED)
        repo = Path(scratch) / "repo"
        shutil.copytree(Path(scratch) / "default", repo, ignore=shutil.ignore_patterns("forge-manifest.json"))
        shutil.copytree(Path(scratch) / "seed" / f"{SEED}ensemble", repo / f"{SEED}ensemble")
        chosen = find_note(default, "python_target").get("runtime", {})
        with TritonServer(repo, startup_timeout=900) as server:
            for name, model in (("forge default build", "ensemble"), ("seed-000 hf-pipeline", f"{SEED}ensemble")):
                for concurrency in (1, 8):
                    count = max(4, args.requests // 4) if concurrency == 1 else args.requests
                    started = time.perf_counter()
                    summary = measure(server.grpc_url, model, tokenizer, concurrency, count, args.max_tokens)
                    summary.update({"server": name, "concurrency": concurrency,
                                    "run": f"{name}, c={concurrency}"})
                    rows.append(summary)
                    print(f"  {summary['run']}: {summary['tokens_per_s']:.1f} generated tok/s "
                          f"({time.perf_counter() - started:.0f}s)", flush=True)
    by = {(r["server"], r["concurrency"]): r for r in rows}
    ratio = by[("forge default build", 8)]["tokens_per_s"] / max(by[("seed-000 hf-pipeline", 8)]["tokens_per_s"], 1e-9)
    print()
    print(f"{label}, {args.max_tokens} new tokens, greedy, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(f"  forge default build: --target python; its manifest: {json.dumps(chosen)}")
    print("  seed-000 model: --target hf-pipeline: text-generation pipeline per request, float16, torch's "
          f"default threads ({torch.get_num_threads()} here), max_batch_size 0, one instance")
    print(format_table(rows, label="run"))
    print(f"forge default / seed-000 model, generated tokens/s at concurrency 8: {ratio:.1f}x (goal ≥ 4x)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": label, "max_tokens": args.max_tokens, "rows": rows,
                                             "default_build": chosen, "ratio_c8": ratio}, indent=2))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
