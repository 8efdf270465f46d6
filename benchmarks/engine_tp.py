"""The python target's engine alone (no Triton) at tp N vs tp 1: decode ms/step on the CUDA-graph decoder.

For each model shape (random weights, float16): tp 1 on GPU 0 (torch.compile off and auto), then tp N under
``mpirun -n N`` (one GPU per rank, NCCL; rank 0 leads, the others follow every step as served ranks do), at
1 / 16 / 64 rows of 32-token prompts; tp N with ``-o torch_compile=auto``, the default. What a served tp N
build adds on top (Triton, the ensemble, host work per request) is ``serve_tp.py``'s to measure.

    python benchmarks/engine_tp.py [--shapes tinyllama,llama8b] [--tp 2] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = (1, 16, 64)
STEPS = 32


def runtime_path() -> str:
    """The directory holding ``forge_decoder`` (what a served repository ships beside model.py); nothing
    else of forge is imported, so this runs on any Python with torch and transformers."""
    return str(Path(__file__).resolve().parents[1] / "core" / "forge" / "in_triton" / "python_target")


def measure(engine_factory, model, device, *, compile: str = "false") -> list[dict]:
    """ms per decoding step at each row count, on one engine (graphs captured per row count)."""
    import torch

    from forge_decoder.request import GenerationRequest, Limits
    from forge_decoder.sequences import Sequence

    engine = engine_factory(model, Limits(model.config.vocab_size, 512, 1024), max_rows=max(ROWS))
    capture = device.type == "cuda"
    chosen = engine.use_graphs("true" if capture else "auto", capture=capture, compile=compile, paged="false")
    out = []
    with torch.inference_mode():
        for rows in ROWS:
            engine.submit([Sequence(GenerationRequest(list(range(100 + i, 132 + i)), STEPS + 8), lambda s, u: None)
                           for i in range(rows)])
            for _ in range(4):  # the prefill, then steps that capture
                engine.step()
            torch.cuda.synchronize() if capture else None
            start = time.perf_counter()
            for _ in range(STEPS):
                engine.step()
            torch.cuda.synchronize() if capture else None
            ms = (time.perf_counter() - start) / STEPS * 1000
            out.append({"rows": rows, "ms_per_step": round(ms, 3), "tokens_per_s": round(rows / ms * 1000, 1),
                        "chosen": chosen})
            engine.run_until_idle()
    return out


class _NoSum:
    """``--all-reduce none``: the ranks skip their sums (wrong tokens; what a step costs without them)."""

    def takes(self, tensor) -> bool:
        return tensor.is_cuda

    def __call__(self, tensor):
        return tensor


def worker(model_dir: str, compile: str = "auto", hang_s: float = 0, all_reduce: str = "auto") -> None:
    """One rank under mpirun: rank 0 measures (printing one json line), the others follow. With ``hang_s``,
    a rank still running after that long prints every thread's stack and exits (where a hang waits)."""
    import torch

    if hang_s:
        import faulthandler

        faulthandler.dump_traceback_later(hang_s, exit=True)

    from forge_decoder import distributed, ranks

    rank, size = ranks.world_from_env()
    device = distributed.rank_device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if rank:
        group = ranks.join(size)
        settings = group.broadcast().settings
        model = distributed.load_shard(settings["weights"], device, torch.float16 if device.type == "cuda"
                                       else torch.float32, group, "nccl" if all_reduce == "none" else all_reduce)
        group.summed = _NoSum() if all_reduce == "none" else group.summed
        distributed.Follower(model, group).run()
        if not group.close():  # as a served follower does
            ranks.leave_now()
        return
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model, make_engine = distributed.lead(size, model_dir, device, dtype, 1, "nccl" if all_reduce == "none" else all_reduce)
    group = make_engine.keywords["group"]
    group.summed = _NoSum() if all_reduce == "none" else group.summed
    rows = measure(make_engine, model, device, compile=compile)
    for row in rows:
        row["all_reduce"] = "none (sums skipped)" if all_reduce == "none" else group.summing
    print("RESULT " + json.dumps(rows), flush=True)  # before the teardown: a hang there keeps the numbers
    group.send(ranks.Command("stop"))
    if not group.close():
        print("teardown: the process groups' teardown did not finish", flush=True)
        ranks.leave_now()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tinyllama,llama8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--tp-compile", default="auto", choices=("auto", "true", "false"),
                        help="-o torch_compile of the tp N engine (default auto, the default build's)")
    parser.add_argument("--no-tp1", action="store_true", help="only tp N (tp 1 measured before)")
    parser.add_argument("--hang-s", type=float, default=0,
                        help="a tp N rank still running after this many seconds prints its threads' stacks and exits")
    parser.add_argument("--all-reduce", default="auto",
                        help="how the tp N ranks sum, comma-separated to compare: auto, nccl, one-shot, two-shot, "
                             "peer-sum, or none (sums skipped: the step's cost without them, wrong tokens)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank under mpirun: the model directory
    args = parser.parse_args()
    sys.path.insert(0, runtime_path())
    if args.worker:
        worker(args.worker, args.tp_compile, args.hang_s, args.all_reduce)
        return 0

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from forge_decoder.engine import Engine, load_model
    from gpu_shapes import make_model

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    report = {"command": "python benchmarks/engine_tp.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "gpus": torch.cuda.device_count(), "torch": torch.__version__, "shapes": {}}
    print(json.dumps({k: report[k] for k in ("gpu", "gpus", "torch")}), flush=True)
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"forge-engine-tp-{shape}-") as scratch:
            model_dir = make_model(shape, None, Path(scratch) / "model", "float16")
            entry: dict = {}
            model = load_model(model_dir, device, dtype)
            for compile in () if args.no_tp1 else ("false", "auto"):
                entry[f"tp1_compile_{compile}"] = measure(Engine, model, device, compile=compile)
                print(f"{shape} tp 1, torch_compile={compile}: {json.dumps(entry[f'tp1_compile_{compile}'])}",
                      flush=True)
            del model
            torch.cuda.empty_cache() if device.type == "cuda" else None
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
                   "PYTHONPATH": os.pathsep.join(p for p in (runtime_path(), os.environ.get("PYTHONPATH")) if p)}
            for method in args.all_reduce.split(","):
                key = f"tp{args.tp}" if method == "auto" else f"tp{args.tp}_{method}"
                cmd = ["mpirun", "--allow-run-as-root", "-n", str(args.tp), "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
                       "-x", "PYTHONPATH", sys.executable, __file__, "--worker", str(model_dir),
                       "--tp-compile", args.tp_compile, "--hang-s", str(args.hang_s), "--all-reduce", method]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if not found:
                    print(f"{shape} {key}: mpirun exited {done.returncode}\n{done.stdout[-3000:]}\n"
                          f"{done.stderr[-12000:]}", flush=True)
                    entry[key] = {"error": (done.stderr or done.stdout)[-2000:]}
                    continue
                # the numbers are printed before the teardown: a rank failing there still measured them
                entry[key] = json.loads(found[0].removeprefix("RESULT "))
                entry["tp_compile"] = args.tp_compile
                entry[f"{key}_mpirun_exit"] = done.returncode
                if "teardown: " in done.stdout:  # rank 0 left without finishing it (leave_now)
                    entry[f"{key}_teardown"] = "the process groups' teardown did not finish"
                if done.returncode:
                    entry[f"{key}_teardown_error"] = (done.stderr or done.stdout)[-2000:]
                print(f"{shape} {key}: {json.dumps(entry[key])}; mpirun exited {done.returncode}", flush=True)
            report["shapes"][shape] = entry
        if args.json_out:
            save(report, args.json_out)
    return 0


def _form(key: str) -> str:
    """A report key (``tp1_compile_false``, ``tp2``, ``tp2_nccl``) as a column heading."""
    tp, _, form = key.partition("_")
    form = {"compile_false": "layers eager", "compile_auto": "layers compiled"}.get(form, form.replace("_", " "))
    return f"tp {tp[2:]}" + (f", {form}" if form else "") + " ms"


def results_table(report: dict) -> dict:
    """The report as the docs' table: ms per decoding step by shape and rows, a column per form measured."""
    forms = list(dict.fromkeys(k for entry in report["shapes"].values() for k, v in entry.items()
                               if isinstance(v, list)))
    rows, notes = [], []
    for shape, entry in report["shapes"].items():
        by = {k: {r["rows"]: r["ms_per_step"] for r in entry[k]} for k in forms if isinstance(entry.get(k), list)}
        for n in sorted({n for cells in by.values() for n in cells}):
            rows.append([shape, n, *["—" if by.get(k, {}).get(n) is None else f"{by[k][n]:.2f}" for k in forms]])
        notes += [f"{shape} {k}: not measured (its error is in the file)" for k, v in entry.items()
                  if isinstance(v, dict) and "error" in v]
        notes += [f"{shape} {k.removesuffix('_mpirun_exit')}: the ranks measured, then mpirun exited {v}"
                  for k, v in entry.items() if k.endswith("mpirun_exit") and v]
    compile = next((e["tp_compile"] for e in report["shapes"].values() if "tp_compile" in e), "auto")
    return {"title": "Tensor parallel, the engine alone", "columns": ["shape", "rows", *map(_form, forms)],
            "rows": rows, "notes": "; ".join(notes) + ("." if notes else ""),
            "machine_line": f"{report['gpus']} × {report['gpu']}, torch {report['torch']}",
            "description": "Random-weight float16 models of each shape, no Triton: ms per decoding step of the "
                           "CUDA-graph decoder at each number of rows (32-token prompts). tp 1 on one GPU; tp N "
                           f"under mpirun, one GPU per rank, NCCL, `-o torch_compile={compile}`."}


def save(report: dict, out: Path) -> None:
    """The report as a results file: the table the docs show, the raw report beside it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gen_docs

    raw = {k: v for k, v in report.items() if k not in ("command", "date")}
    gen_docs.write_results("engine_tp", out=out, command=report["command"], **results_table(report), **raw)


if __name__ == "__main__":
    sys.exit(main())
