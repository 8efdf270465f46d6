"""Tensor parallel on the python target: the default ``--tp 2`` build (the CUDA-graph decoder on every rank) vs the
default ``--tp 1`` build, each served by ``forge serve`` (tp 2: two ranks under mpirun, one GPU each, NCCL).

For each model shape (random weights, seeded; SmolLM2's tokenizer):
  1. with ``--parity``: float32 builds at tp 1 and tp 2; greedy ids of ``tensorrt_llm`` for a few prompts,
     compared (the first divergence reported);
  2. the float16 builds (both default; ``--tp-args`` adds build arguments to tp N's), each alone on the host:
     closed-loop load through the ensemble (~32-token prompts, 64 new tokens) at each concurrency, with the
     engine's own counters (ms per step, rows per step).

    python benchmarks/serve_tp.py --tokenizer DIR [--shapes tinyllama] [--concurrency 16,64] [--parity]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_shapes import make_model  # noqa: E402
from serve_gpu import build, load, prompts  # noqa: E402


class Served:
    """``forge serve REPO --json`` in the background until it prints its endpoints; ``stop`` ends every rank."""

    def __init__(self, repo: Path, log: Path, timeout_s: float = 900):
        self.stop_s = self.exit_status = None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "forge", "serve", str(repo), "--json", "--no-openai", "--log-file", str(log),
             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        started, text = time.monotonic(), ""
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise SystemExit(f"benchmark: forge serve {repo} exited with {self.process.wait()}; see {log}")
            text += line
            if line.rstrip() == "}":
                break
        info = json.loads(text)
        self.startup_s = round(time.monotonic() - started, 1)
        self.grpc_url, self.metrics_url, self.world_size = info["grpc"], info["metrics"], info["world_size"]
        if time.monotonic() - started > timeout_s:
            self.stop()
            raise SystemExit(f"benchmark: forge serve {repo} took over {timeout_s} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole session after 120 s; ``stop_s`` and ``exit_status`` say how it went
        (exit status None: it had to be killed)."""
        if self.process.poll() is None:
            started = time.monotonic()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.exit_status = self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.exit_status = None
            self.stop_s = round(time.monotonic() - started, 1)

    def __enter__(self) -> "Served":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def greedy_ids(grpc_url: str, tokenizer, count: int = 4, n: int = 32) -> list[list[int]]:
    """Greedy ids of the served ``tensorrt_llm`` model for ``count`` prompts."""
    import numpy as np
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(grpc_url)
    out = []
    for text in prompts(tokenizer, count):
        ids = tokenizer.encode(text, add_special_tokens=True)
        inputs = []
        for name, value in (("input_ids", np.array([ids], np.int32)),
                            ("input_lengths", np.array([[len(ids)]], np.int32)),
                            ("request_output_len", np.array([[n]], np.int32))):
            tensor = grpc.InferInput(name, list(value.shape), "INT32")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        out.append(client.infer("tensorrt_llm", inputs).as_numpy("output_ids").reshape(-1).tolist()[len(ids):])
    client.close()
    return out


def decoder_line(log: Path) -> str | None:
    """What the served model's log says its decoder chose (CUDA graphs, KV cache, attention, compile)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return next((line[line.index("CUDA graphs"):].strip() for line in text.splitlines() if "CUDA graphs" in line), None)


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, the length of the equal prefix."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a SmolLM2 directory (config + tokenizer)")
    parser.add_argument("--shapes", default="tinyllama")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tp-args", default="", help="the tp N build's extra forge build arguments (default: none)")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--waves", type=int, default=16, help="requests per cell, as a multiple of its concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--parity", action="store_true", help="float32 builds at tp 1 and tp N: greedy ids equal?")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    report = {"command": "python benchmarks/serve_tp.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "shapes": {}}
    print(json.dumps({k: report[k] for k in ("gpu", "gpus", "torch")}), flush=True)
    if torch.cuda.device_count() < args.tp:
        sys.exit(f"benchmark: --tp {args.tp} needs {args.tp} GPUs; this host has {torch.cuda.device_count()}")
    forms = {1: (), args.tp: tuple(args.tp_args.split())}
    for shape in args.shapes.split(","):
        entry: dict = {"rows": []}
        report["shapes"][shape] = entry
        with tempfile.TemporaryDirectory(prefix=f"forge-tp-{shape}-") as scratch:
            root = Path(scratch)
            if args.parity:
                model_dir = make_model(shape, args.tokenizer, root / "model32", "float32")
                answers = {}
                for tp, extra in forms.items():
                    repo = root / f"f32-tp{tp}"
                    build(model_dir, repo, "--target", "python", "--dtype", "float32", "--tp", str(tp), *extra)
                    with Served(repo, root / f"f32-tp{tp}.log") as server:
                        answers[tp] = greedy_ids(server.grpc_url, tokenizer)
                prefixes = first_difference(answers[1], answers[args.tp])
                entry["parity"] = {"dtype": "float32", "tokens": len(answers[1][0]), "equal_prefix": prefixes,
                                   "tp1": [a[:8] for a in answers[1]], f"tp{args.tp}": [a[:8] for a in answers[args.tp]]}
                print(f"{shape}: greedy ids, tp {args.tp} vs tp 1 (float32): {json.dumps(entry['parity'])}", flush=True)
                shutil.rmtree(model_dir)
            model_dir = make_model(shape, args.tokenizer, root / "model", "float16")
            for tp, extra in forms.items():
                repo = root / f"tp{tp}"
                build(model_dir, repo, "--target", "python", "--dtype", "float16", "--tp", str(tp), *extra)
                with Served(repo, root / f"tp{tp}.log") as server:
                    print(f"{shape}: tp {tp} ready in {server.startup_s} s", flush=True)
                    entry[f"startup_s_tp{tp}"] = server.startup_s
                    for c in (int(x) for x in args.concurrency.split(",")):
                        summary = load(server, "ensemble", tokenizer, c, args.waves * c, args.max_tokens,
                                       engine_model="tensorrt_llm")
                        summary.update({"run": f"{shape} tp {tp}, c={c}", "tp": tp, "concurrency": c,
                                        "build": " ".join(("--tp", str(tp), *extra))})
                        entry["rows"].append(summary)
                        print(f"  {summary['run']}: {summary['tokens_per_s']:.1f} tok/s, p50 "
                              f"{(summary.get('latency_ms') or {}).get('p50', '-')} ms; engine "
                              f"{json.dumps({k: v for k, v in summary.items() if k.startswith('engine_')})}", flush=True)
                        if args.json_out:
                            save(report, args.json_out)
                entry[f"stop_tp{tp}"] = {"seconds": server.stop_s, "exit_status": server.exit_status}
                entry[f"decoder_tp{tp}"] = decoder_line(root / f"tp{tp}.log")
                print(f"{shape}: tp {tp} stopped in {server.stop_s} s, exit status {server.exit_status}; decoder: "
                      f"{entry[f'decoder_tp{tp}']}", flush=True)
                shutil.rmtree(repo, ignore_errors=True)
            by = {(r["tp"], r["concurrency"]): r["tokens_per_s"] for r in entry["rows"]}
            entry["ratio"] = {c: round(by[(args.tp, c)] / by[(1, c)], 2) for (tp, c) in by if tp == 1
                              and (args.tp, c) in by and by[(1, c)]}
            print(f"{shape}: tp {args.tp} / tp 1 tok/s by concurrency: {json.dumps(entry['ratio'])}", flush=True)
        if args.json_out:
            save(report, args.json_out)
    return 0


def _f(value: object, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def results_table(report: dict) -> dict:
    """The report as the docs' table: every served cell, with the tp N / tp 1 ratios and parity as notes."""
    rows, notes = [], []
    for shape, entry in report["shapes"].items():
        for r in entry.get("rows") or []:
            latency = r.get("latency_ms") or {}
            rows.append([shape, r["tp"], f"`{r['build']}`", r["concurrency"], r["requests"],
                         _f(r.get("tokens_per_s"), ".1f"), _f(latency.get("p50"), ".0f"), _f(latency.get("p99"), ".0f"),
                         _f(r.get("engine_ms_per_step"), ".2f"), _f(r.get("engine_mean_rows"), ".1f"), r["errors"]])
        if entry.get("ratio"):
            notes.append(f"{shape}: tok/s of tp N over tp 1 " + ", ".join(
                f"{r}× at {c} clients" for c, r in entry["ratio"].items()))
        if entry.get("parity"):
            p = entry["parity"]
            notes.append(f"{shape}: greedy ids of tp N against tp 1 in {p['dtype']}, equal prefix per prompt over "
                         f"{p['tokens']} tokens: {', '.join(map(str, p['equal_prefix']))}")
        stops = [(k[len("stop_tp"):], v) for k, v in entry.items() if k.startswith("stop_tp") and v]
        if stops:
            notes.append(f"{shape}: " + ", ".join(f"tp {tp} stopped on SIGTERM in {v['seconds']} s, exit status "
                                                   f"{v['exit_status']}" for tp, v in stops))
    return {"title": "Tensor parallel, served", "rows": rows, "notes": "; ".join(notes) + ("." if notes else ""),
            "columns": ["shape", "tp", "build", "concurrency", "requests", "generated tok/s", "p50 ms", "p99 ms",
                        "engine ms/step", "engine's mean batch", "errors"],
            "machine_line": f"{report['gpus']} × {report['gpu']}, torch {report['torch']}",
            "description": "Random-weight float16 models of each shape (SmolLM2's tokenizer), the default "
                           "`--target python` builds, each alone in its `forge serve` (tp N: N ranks under "
                           "mpirun, NCCL); closed loop through the ensemble, ~32-token prompts, 64 new tokens."}


def save(report: dict, out: Path) -> None:
    """The report as a results file: the table the docs show, the raw report beside it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gen_docs

    raw = {k: v for k, v in report.items() if k not in ("command", "date")}
    gen_docs.write_results("serve_tp", out=out, command=report["command"], **results_table(report), **raw)


if __name__ == "__main__":
    sys.exit(main())
