"""All-reduce latency between the GPUs of one host, the way a tensor-parallel decoding step uses it.

A decoding step of a tp N model sums two row-parallel outputs per layer ([rows, hidden], float16) across the
ranks, inside the step's CUDA graph: TinyLlama's 22 layers make 44 all-reduces a step, Llama-3-8B's 32 make 64.
This measures, per all-reduce inside a captured graph (64 chained all-reduces, replayed), each way forge can
sum: NCCL (``nccl``), and through PyTorch's symmetric memory (``torch.distributed._symmetric_memory``, peer
buffers over NVLink): its ``one_shot_all_reduce`` and ``two_shot_all_reduce_`` kernels, a copy, barrier, add and
barrier (``peer-sum``), and forge's one Triton kernel doing all of that (``fused``; see forge_decoder/allreduce.py).
Each way is first checked for the right sum; a way that fails reports its error instead of a number.

    python benchmarks/allreduce_tp.py [--tp 2] [--hidden 2048,4096] [--rows 1,16,64] [--json-out FILE]

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``): no multimem kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine_tp import runtime_path  # beside this script: the runtime directory a served repository ships

CHAIN = 64  # all-reduces captured in one graph
REPLAYS = 50
METHODS = ("nccl", "one-shot", "two-shot", "peer-sum", "fused")  # ranks.ALL_REDUCES (not imported here)


def _first(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _measure(group, rank: int, size: int, device, dtype, rows: int, hidden: int) -> dict:
    """One shape: the sum checked eagerly, then µs per all-reduce over CHAIN of them in a replayed graph."""
    import torch
    import torch.distributed as dist

    cell = {"hidden": hidden, "rows": rows, "bytes": rows * hidden * torch.finfo(dtype).bits // 8}
    x = torch.full((rows, hidden), float(rank + 1), dtype=dtype, device=device)
    try:
        got = group.all_reduce(x.clone())
        cell["right_sum"] = bool(torch.all(got == float(size * (size + 1) // 2)).item())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (NCCL's first call sets up)
            y = x.clone()
            for _ in range(3):
                y = group.all_reduce(y)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        y = x.clone()
        with torch.cuda.graph(graph):
            out = y
            for _ in range(CHAIN):
                out = group.all_reduce(out)
        graph.replay()
        torch.cuda.synchronize()
        dist.barrier(group=group.control)
        start = time.perf_counter()
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        cell["us_per_all_reduce"] = round((time.perf_counter() - start) / REPLAYS / CHAIN * 1e6, 2)
        del graph
    except Exception as exc:  # noqa: BLE001 - this shape's result
        cell["error"] = f"{type(exc).__name__}: {_first(exc)}"
    return cell


def worker(hidden: list[int], rows: list[int], methods: list[str], dtypes: list[str]) -> None:
    """One rank under mpirun: every rank measures; rank 0 prints one json line."""
    import torch

    from forge_decoder import distributed, ranks

    rank, size = ranks.world_from_env()
    device = distributed.rank_device("cuda")
    group = ranks.join(size)
    ranks.use_device(group, device)
    results: dict = {"methods": {}}
    for method in methods:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            key = f"{method} {dtype_name}"
            try:
                ranks.use_all_reduce(group, method, device, dtype, max(hidden))
            except Exception as exc:  # noqa: BLE001 - reported as this method's result
                results["methods"][key] = {"error": f"{type(exc).__name__}: {_first(exc)}"}
                continue
            results["methods"][key] = [_measure(group, rank, size, device, dtype, r, h) for h in hidden for r in rows]
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    group.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", default="2048,4096")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    hidden = [int(x) for x in args.hidden.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    sys.path.insert(0, runtime_path())
    if args.worker:
        worker(hidden, rows, args.methods.split(","), args.dtypes.split(","))
        return 0
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + os.getpid() % 1000),
           "PYTHONPATH": os.pathsep.join(p for p in (runtime_path(), os.environ.get("PYTHONPATH")) if p),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    cmd = ["mpirun", "--allow-run-as-root", "-n", str(args.tp)]
    for name in ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        cmd += ["-x", name]
    cmd += [sys.executable, __file__, "--worker", "--hidden", args.hidden, "--rows", args.rows, "--methods", args.methods, "--dtypes", args.dtypes]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        print(f"mpirun exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}", flush=True)
        return 1
    results = json.loads(found[0].removeprefix("RESULT "))
    import torch

    report = {"command": "python benchmarks/allreduce_tp.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "tp": args.tp, "chain": CHAIN, **results}
    for method, rows_out in results["methods"].items():
        if isinstance(rows_out, dict):
            print(f"{method:>18}: {rows_out['error']}")
            continue
        cells = [f"{r['rows']}x{r['hidden']} " + (f"{r['us_per_all_reduce']} us{'' if r['right_sum'] else ' WRONG SUM'}"
                                                  if "error" not in r else r["error"]) for r in rows_out]
        print(f"{method:>18}: " + " | ".join(cells))
    if args.json_out:
        save(report, args.json_out)
    return 0


def results_table(report: dict) -> dict:
    """The report as the docs' table: µs per all-reduce by shape, a column per way and dtype."""
    methods = {m: cells for m, cells in report["methods"].items() if isinstance(cells, list)}
    shapes = sorted({(c["rows"], c["hidden"]) for cells in methods.values() for c in cells}, key=lambda s: (s[1], s[0]))

    def cell(method: str, shape: tuple[int, int]) -> str:
        found = next((c for c in methods[method] if (c["rows"], c["hidden"]) == shape), None)
        if found is None or "error" in found:
            return "—"
        return f"{found['us_per_all_reduce']:.1f}" + ("" if found.get("right_sum") else " (wrong sum)")

    failed = [m for m, cells in report["methods"].items() if isinstance(cells, dict)]
    return {"title": "All-reduce between the GPUs of one host", "columns": ["rows × hidden", *methods],
            "rows": [[f"{r} × {h}", *[cell(m, (r, h)) for m in methods]] for r, h in shapes],
            "notes": f"Not measured: {', '.join(failed)} (the error is in the file)." if failed else "",
            "machine_line": f"{report['gpus']} × {report['gpu']}, torch {report['torch']}",
            "description": f"µs per all-reduce of [rows, hidden] inside a CUDA graph ({report['chain']} chained, "
                           f"replayed), tp {report['tp']}, NVLink multicast off; every way's sum checked first."}


def save(report: dict, out: Path) -> None:
    """The report as a results file: the table the docs show, the raw report beside it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gen_docs

    raw = {k: v for k, v in report.items() if k not in ("command", "date")}
    gen_docs.write_results("allreduce_tp", out=out, command=report["command"], **results_table(report), **raw)


if __name__ == "__main__":
    sys.exit(main())
