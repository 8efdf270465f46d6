"""Serving benchmark: forge's DEFAULT python-target build vs seed 000's model, one run on one server.

(a) forge default: ``forge build --family F --model M --target python`` (no other flag: whatever dtype
    and threads the default chooses on this machine), asked through its text model (the LLM-API
    ``tensorrt_llm`` model of the newest release, or an older release's ensemble);
(b) seed 000's model as that recipe writes it: ``forge build --target hf-pipeline`` (the Hugging Face
    ``text-generation`` pipeline per request, float16, torch's default threads, max_batch_size 0,
    one instance), under the name prefix ``seed_``.
Both are greedy and get the same chat-templated prompts; both run in one real tritonserver; no
environment variable is set. Closed-loop load at concurrency 1, 8 and 32, 32 new tokens; generated tokens
are counted with the model's tokenizer in the text each returns (requests ask for the generated text
only: ``sampling_param_exclude_input_from_output`` / ``exclude_input_in_output``, inputs the models honour). Prints both configurations,
req/s, generated tokens/s, p50/p99 latency and the tokens/s ratio at concurrency 8 (goal ≥ 4×), and
writes them to benchmarks/experiments/serve_decoder-<date>.json (``--json-out``); the docs show the one in results/.

``--forge-bench`` measures the same two builds with ``forge bench --compare`` instead, as a user runs it
(each repository served for its turn, ``--sweep 1,4``, 8 requests per load, 16 new tokens), and writes
its comparison to benchmarks/experiments/forge_bench_compare-<date>.json.

    python benchmarks/serve_decoder.py [--model smollm2|HF_DIR] [--requests 32] [--forge-bench] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402 - the results file shape the docs read

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
BASELINE = "hf-pipeline baseline"


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
    from forge.loadgen import runner as bench
    from forge.clients.inference import GrpcSession

    with GrpcSession(url) as session:
        inputs = session.config(model)
    # Both models return only the generated text when asked (a request input, not a build flag), so the
    # count is exact: no echoed chat-templated prompt to strip.
    target = bench.Target(inputs, stream=False, extra={"exclude_input": True},
                          count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    items = bench.prompts([chat(tokenizer, p) for p in PROMPTS], requests, max_tokens)
    bench.run(url, target, items[:2], concurrency=1)  # warm-up, not measured
    samples, wall = bench.run(url, target, items, concurrency=concurrency)
    return bench.summarize(samples, wall)


def forge_bench(default: Path, baseline: Path, scratch: Path, plot: Path | None) -> dict:
    """``forge bench --compare`` of the two repositories as a user types it, run as its own process; its json."""
    prompts = scratch / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    argv = ["bench", "--compare", default.name, baseline.name, "--baseline", baseline.name, "--sweep", "1,4",
            "--plot", str(plot or scratch / "bench.png"), "prompts", "--prompts-file", prompts.name,
            "--chat-template", "--output-len", "16", "--num-requests", "8"]
    print("$ forge " + " ".join(argv), flush=True)
    done = subprocess.run([sys.executable, "-m", "forge", *argv, "--json"], cwd=scratch, stdout=subprocess.PIPE,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"benchmark: forge bench failed (exit {done.returncode})")
    shown = ["forge", *argv]
    shown[shown.index("--plot") + 1] = "PLOT.png"
    return {"command": " ".join(shown), **json.loads(done.stdout)}


def _ms(stats: dict | None, key: str) -> float | None:
    value = (stats or {}).get(key)
    return None if value is None else round(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (the real SmolLM2-135M-Instruct) or an HF dir")
    parser.add_argument("--requests", type=int, default=32, help="requests per run at concurrency 8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--forge-bench", action="store_true",
                        help="measure with forge bench --compare --sweep 1,4 (one server at a time) instead")
    parser.add_argument("--plot", type=Path, default=None, help="with --forge-bench: keep its plot (PNG) here")
    gen_docs.add_results_arguments(parser, "serve_decoder / forge_bench_compare")
    args = parser.parse_args(argv)
    load = os.getloadavg()

    import torch
    from transformers import AutoTokenizer

    from forge.loadgen.runner import format_table
    from forge.server.triton_server import TritonServer

    if args.model == "smollm2":
        import smollm2

        model_dir, label = smollm2.hf_dir(), "SmolLM2-135M-Instruct"
    else:
        model_dir, label = Path(args.model), Path(args.model).name
    machine = gen_docs.machine(args.machine_note, load) + f", torch {torch.__version__}"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    family = family_of(model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="forge-serve-bench-") as scratch:
        if args.forge_bench:
            slug = label.split("-")[0].lower()
            default_dir, baseline_dir = Path(scratch) / f"{slug}-default", Path(scratch) / f"{slug}-hf-pipeline"
            default = build(model_dir, default_dir, family, "--target", "python")
            build(model_dir, baseline_dir, family, "--target", "hf-pipeline")
            report = forge_bench(default_dir, baseline_dir, Path(scratch), args.plot)
        else:
            default = build(model_dir, Path(scratch) / "default", family, "--target", "python")
            build(model_dir, Path(scratch) / "seed", family, "--target", "hf-pipeline", "--name-prefix", SEED)
            repo = Path(scratch) / "repo"
            shutil.copytree(Path(scratch) / "default", repo, ignore=shutil.ignore_patterns("forge-manifest.json"))
            shutil.copytree(Path(scratch) / "seed" / f"{SEED}ensemble", repo / f"{SEED}ensemble")
            with TritonServer(repo, startup_timeout=900) as server:
                # the default build's text model: its ensemble, or (the LLM-API layout) its tensorrt_llm model
                entry = "ensemble" if (Path(scratch) / "default" / "ensemble").is_dir() else "tensorrt_llm"
                for name, model in (("forge default build", entry), (BASELINE, f"{SEED}ensemble")):
                    for concurrency in (1, 8, 32):
                        count = max(4, args.requests // 4) if concurrency == 1 else max(args.requests, concurrency)
                        started = time.perf_counter()
                        summary = measure(server.grpc_url, model, tokenizer, concurrency, count, args.max_tokens)
                        summary.update({"server": name, "concurrency": concurrency,
                                        "run": f"{name}, c={concurrency}"})
                        rows.append(summary)
                        print(f"  {summary['run']}: {summary['tokens_per_s']:.1f} generated tok/s "
                              f"({time.perf_counter() - started:.0f}s)", flush=True)
    chosen = find_note(default, "python_target").get("runtime", {})
    here = chosen.get("on_this_machine") or {}
    choice = (f"the default build chose {here['compute_dtype']} and {here['cpu_threads']} torch thread(s) on this "
              "machine, as its manifest records" if {"compute_dtype", "cpu_threads"} <= set(here) else "")
    if args.forge_bench:
        return _write_forge_bench(report, label, machine, choice, args)

    by = {(r["server"], r["concurrency"]): r for r in rows}
    ratio = by[("forge default build", 8)]["tokens_per_s"] / max(by[(BASELINE, 8)]["tokens_per_s"], 1e-9)
    print()
    print(f"{label}, {args.max_tokens} new tokens, greedy; {machine}")
    print(f"  forge default build: --target python; its manifest: {json.dumps(chosen)}")
    print("  hf-pipeline baseline: --target hf-pipeline: text-generation pipeline per request, float16, torch's "
          f"default threads ({torch.get_num_threads()} here), max_batch_size 0, one instance")
    print(format_table(rows, label="run"))
    print(f"forge default / hf-pipeline baseline, generated tokens/s at concurrency 8: {ratio:.1f}x (goal ≥ 4x)")
    table = [[r["server"], r["concurrency"], r["requests"], round(r["req_per_s"], 2), round(r["tokens_per_s"], 1),
              _ms(r["latency_ms"], "p50"), _ms(r["latency_ms"], "p99"), r["errors"]] for r in rows]
    gen_docs.write_results(
        "serve_decoder", out=args.json_out, machine_line=machine, title="Decoder serving on a CPU",
        description=f"{label}, {len(PROMPTS)} chat prompts, {args.max_tokens} new tokens, greedy, closed loop; "
                    "the default build (`forge build --target python`, nothing else) against the hf-pipeline "
                    "baseline (`--target hf-pipeline`), both in one tritonserver.",
        columns=["model", "concurrency", "requests", "req/s", "generated tok/s", "p50 ms", "p99 ms", "errors"],
        rows=table, notes=f"Generated tokens/s of the default build over the baseline at concurrency 8: "
                          f"{ratio:.1f}× (goal ≥ 4×)" + (f"; {choice}." if choice else "."),
        model=label, max_tokens=args.max_tokens, default_build=chosen, ratio_c8=round(ratio, 3), runs=rows)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def _write_forge_bench(report: dict, label: str, machine: str, choice: str, args: argparse.Namespace) -> int:
    """forge bench's comparison as the generic results table."""
    runs = report["runs"]
    table = [[r["target"], r["load"], round(r["req_per_s"], 2), round(r["tokens_per_s"], 1),
              _ms(r["latency_ms"], "p50"), _ms(r["latency_ms"], "p90"), _ms(r["latency_ms"], "p99"), r["errors"],
              f"{r['req_per_s_ratio']:.2f}×" if r.get("req_per_s_ratio") is not None else "—"] for r in runs]
    gen_docs.write_results(
        "forge_bench_compare", out=args.json_out, machine_line=machine,
        title="forge bench --compare on a CPU",
        description=f"{label}, the default build against the hf-pipeline build, one server at a time: "
                    f"`{report['command']}` (prompts.txt: the {len(PROMPTS)} prompts of "
                    "`benchmarks/serve_decoder.py`, one a line).",
        columns=["target", "load", "req/s", "tok/s", "p50 ms", "p90 ms", "p99 ms", "errors", "× req/s"],
        rows=table, notes=choice[:1].upper() + choice[1:] + "." if choice else "",
        model=label, bench=report)
    return 0 if all(r["errors"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
