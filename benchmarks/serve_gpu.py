"""GPU serving benchmark: forge's DEFAULT python-target build vs seed 000's model (``--target hf-pipeline``).

For each model shape (random weights, seeded; the tokenizer of SmolLM2):
  1. ``forge build --target python`` (nothing else: one decoupled ``tensorrt_llm`` model with TensorRT-LLM's
     LLM-API interface) and ``forge build --target hf-pipeline`` (float16), served together by one real
     tritonserver through ``forge serve``'s launcher;
  2. correctness: the served ``tensorrt_llm`` model's greedy text vs transformers ``generate`` on the same GPU
     in the served dtype (the number of reference tokens whose text the served answer starts with);
  3. closed-loop load on the ``tensorrt_llm`` model (the pipeline's ensemble): ~32-token prompts, 64 new tokens,
     concurrency 1 / 16 / 64 (the pipeline at 1 and 16), generated tokens counted with the tokenizer in the
     returned text; and streamed (``streaming`` true) at 16 and 64 (time to first token, inter-token latency);
  4. the engine alone (no Triton): decode ms/step at 1 / 16 / 64 rows, per step form (Hugging Face forward;
     CUDA graphs with each attention form), the distance to the memory-bandwidth limit (weight bytes per
     step / the GPU's bandwidth), kernels per decoding step, and prefill ms (16 and 64 prompts of 32 tokens,
     the static decoder's own prefill vs the Hugging Face forward); served tok/s as a share of the engine's.

    python benchmarks/serve_gpu.py --tokenizer DIR [--shapes smollm2,tinyllama] [--bandwidth-tbs 3.35]
    python benchmarks/serve_gpu.py --engine-only [--shapes smollm2,tinyllama,gpt2]  # 4. alone: no tritonserver
    python benchmarks/serve_gpu.py --tokenizer DIR --no-engine --profile-gil 10   # after the cells, who holds the
                                                                # served model's GIL under c=64 (py-spy --gil)
    python benchmarks/serve_gpu.py --tokenizer DIR --soak 600   # every shape's default build in one server under
                                                                # c=64 for 600 s each, then a stop: hung requests,
                                                                # errors, exit status, segfaults in the kernel log

The served measurements are here; the engine alone (4. and ``--closed-loop``) is engine_gpu.py, the model shapes
gpu_shapes.py, what a cell cost the server (CPU, Triton's durations, the engine's counters) served_metrics.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import closed_loop, engine_report, prefill_ms  # noqa: E402
from gpu_shapes import check_disk, make_model  # noqa: E402
from serve_decoder import find_note  # noqa: E402
from served_metrics import (cores_busy, engine_counters, engine_share, model_durations,  # noqa: E402
                            per_request_ms, process_cpu)

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above an old quiet "
         "harbour town where sailors tell long stories about distant islands and forgotten treasure").split()


def build(model_dir: Path, out: Path, *extra: str) -> dict:
    from forge.cli import main

    argv = ["build", "--family", "llama", "--model", str(model_dir), "--out", str(out), *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    if model_dir.stat().st_dev != out.parent.stat().st_dev:  # the weights are copied, not hard-linked
        check_disk(out.parent, sum(f.stat().st_size for f in model_dir.rglob("*") if f.is_file()), "the build")
    print("$ forge " + " ".join(argv), flush=True)
    if main(argv) != 0:
        sys.exit("benchmark: forge build failed")
    return json.loads((out / "forge-manifest.json").read_text())


def prompts(tokenizer, count: int, length: int = 32) -> list[str]:
    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(length * 2)]
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > length:
            words.pop()
        out.append(" ".join(words))
    return out


def check_greedy(server, model_dir: Path, tokenizer, dtype: str, n: int = 32) -> dict:
    """The served model's greedy text vs transformers generate on this GPU, same prompt ids, same dtype: how many of
    the reference's tokens the served text starts with (decoded the same way)."""
    import torch
    from transformers import AutoModelForCausalLM

    from forge.clients.inference import GrpcSession, text_of

    ids = tokenizer.encode(prompts(tokenizer, 1)[0], add_special_tokens=True)
    with GrpcSession(server.grpc_url) as session:
        inputs = session.config("tensorrt_llm")
        request = {"text_input": "", "prompt_token_ids": ids, "sampling_param_max_tokens": n,
                   "sampling_param_top_k": 1, "sampling_param_ignore_eos": True,
                   "sampling_param_exclude_input_from_output": True}
        answer = "".join(text_of(event.outputs.get("text_output", "")) for event in
                         session.stream("tensorrt_llm", {k: inputs.array(k, v) for k, v in request.items()}))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU runs the served cells too (a smoke test)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device), pad_token_id=0)
    reference = out[0, len(ids):].tolist()
    same = next((i for i in range(1, n + 1) if not answer.startswith(tokenizer.decode(reference[:i]))), n + 1) - 1
    del model
    torch.cuda.empty_cache()
    return {"dtype": dtype, "tokens": n, "equal_prefix": same, "served": answer[:80],
            "transformers": tokenizer.decode(reference)[:80]}


def load(server, model: str, tokenizer, concurrency: int, requests: int, max_tokens: int,
         stream: bool = False, engine_model: str | None = None, processes: int = 1) -> dict:
    """One closed-loop cell after two warm-up waves at the cell's concurrency (the decoder captures a prefill graph
    the first time a batch of prompts of its size arrives; that one-time capture is the warm-up's, recorded as
    ``warmup_s``, not the cell's); with ``engine_model``, what its engine did in the cell.
    With ``processes`` > 1 the clients are split over that many client processes (one Python's GIL can be
    what limits a streamed cell: every response is parsed by the client), started together."""
    from forge.loadgen import runner

    target = _target(server.grpc_url, model, tokenizer, stream)
    items = runner.prompts(prompts(tokenizer, 16), requests, max_tokens)
    warmup = time.perf_counter()
    runner.run(server.grpc_url, target, items[:2 * concurrency], concurrency=concurrency)
    warmup_s = round(time.perf_counter() - warmup, 2)
    before, models_before = engine_counters(server, engine_model), model_durations(server)
    cpu_before, client_before = process_cpu(server), _client_cpu()
    processes = max(1, min(processes, concurrency))  # at most one process per client
    if processes > 1:
        samples = _in_processes(server.grpc_url, model, tokenizer.name_or_path, stream, items, concurrency, processes)
        wall = max(s.done for s in samples) - min(s.sent for s in samples)
    else:
        samples, wall = runner.run(server.grpc_url, target, items, concurrency=concurrency)
    return {**runner.summarize(samples, wall), **engine_share(before, engine_counters(server, engine_model), wall),
            "triton_ms": per_request_ms(models_before, model_durations(server)), "client_processes": processes,
            "cpu_cores": cores_busy(cpu_before, process_cpu(server), wall),
            "client_cores": round((_client_cpu() - client_before) / wall, 2) if wall else None, "warmup_s": warmup_s}


def _client_cpu() -> float:
    """CPU seconds of this process and its finished children (the client processes of a cell, once joined)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _target(url: str, model: str, tokenizer, stream: bool):
    from forge.loadgen import runner
    from forge.clients.inference import GrpcSession

    with GrpcSession(url) as session:
        inputs = session.config(model)
    return runner.Target(inputs, stream=stream, extra={"exclude_input": True},
                        count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))


def _in_processes(url: str, model: str, tokenizer_dir: str, stream: bool, items: list, concurrency: int,
                  processes: int) -> list:
    """``items`` over ``processes`` client processes (``concurrency`` split between them, the total kept),
    released together once every one is ready; their samples (perf_counter is one clock for every process)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_client_process,
                               args=(url, model, tokenizer_dir, stream, items[i::processes],
                                     concurrency // processes + (i < concurrency % processes), ready, results))
               for i in range(processes)]
    for worker in workers:
        worker.start()
    samples = [sample for _ in workers for sample in results.get(timeout=1800)]
    for worker in workers:
        worker.join(60)
    return samples


def _client_process(url, model, tokenizer_dir, stream, items, concurrency, ready, results) -> None:
    from transformers import AutoTokenizer

    from forge.loadgen import runner

    target = _target(url, model, AutoTokenizer.from_pretrained(tokenizer_dir), stream)
    ready.wait(600)
    samples, _ = runner.run(url, target, items, concurrency=concurrency)
    results.put(samples)


def served_share(entry: dict) -> list[dict]:
    """Served tok/s (non-streamed, default build) as a share of the engine alone's decode tok/s at the same
    concurrency (the engine's default step form: CUDA graphs, static KV cache, torch.compile auto, steps
    overlapped)."""
    from forge.in_triton.python_target.forge_decoder import graphs

    engine = {r["rows"]: r["tokens_per_s"] for r in entry.get("engine", [])
              if r["cuda_graphs"] == "true" and r.get("attention_asked", r["attention"]) == graphs.ATTENTION
              and r.get("torch_compile", "false") == "auto" and r.get("paged_kv_cache", "false") == "false"
              and r.get("overlap_steps", "auto") == "auto"}
    shares = []
    for row in entry.get("rows", []):
        if row["server"] == "forge default build" and row["concurrency"] in engine and row["tokens_per_s"]:
            share = row["tokens_per_s"] / engine[row["concurrency"]]
            shares.append({"concurrency": row["concurrency"], "served_tokens_per_s": row["tokens_per_s"],
                           "engine_tokens_per_s": engine[row["concurrency"]], "share": round(share, 3)})
            print(f"  served / engine alone at c={row['concurrency']}: {share:.0%}", flush=True)
    return shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a SmolLM2 directory (config + tokenizer); needed to serve")
    parser.add_argument("--shapes", default="smollm2,tinyllama")
    parser.add_argument("--dtype", default="float16", help="the build's --dtype")
    parser.add_argument("--waves", type=int, default=16,
                        help="requests per forge load cell, as a multiple of its concurrency (a steady state: "
                             "one wave measures mostly the ramp)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes the streamed cells' clients are split over (default 1)")
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="the GPU's memory bandwidth, TB/s")
    parser.add_argument("--forge-args", default="", help="extra forge build arguments (default: none, the default build)")
    parser.add_argument("--no-seed", action="store_true", help="skip the hf-pipeline model (measured before)")
    parser.add_argument("--engine-only", action="store_true", help="only the engine alone (no tritonserver)")
    parser.add_argument("--no-engine", action="store_true", help="only the served cells (the engine alone measured "
                                                                  "before: no served share)")
    parser.add_argument("--soak", type=float, default=0, help="seconds of load for the soak (0: no soak)")
    parser.add_argument("--soak-concurrency", type=int, default=64)
    parser.add_argument("--soak-timeout", type=float, default=120, help="seconds after which a request counts as hung")
    parser.add_argument("--profile-gil", type=float, default=0,
                        help="after the cells, seconds of py-spy (--gil) on the served tensorrt_llm model under c=64 "
                        "non-streamed load: each thread's share of the GIL and the functions holding it (0: none)")
    parser.add_argument("--profile-of", type=lambda text: tuple(text.split(",")), default=("stub",),
                        help="--profile-gil: what is sampled, comma-separated: stub (default), engine (its engine "
                        "process), both under c=64 non-streamed load, or stub-streamed / engine-streamed (under c=16 "
                        "streamed load)")
    parser.add_argument("--stream-levels", type=lambda text: tuple(int(c) for c in text.split(",")),
                        help="the streamed cells' concurrencies (default 16,64)")
    parser.add_argument("--levels", type=lambda text: tuple(int(c) for c in text.split(",") if c),
                        help="the served non-streamed cells' concurrencies (default 1,16,64; empty: none)")
    parser.add_argument("--closed-loop", action="store_true",
                        help="only the engine alone in a closed loop (engine_gpu.closed_loop)")
    parser.add_argument("--jitter-ms", type=float, default=0.0,
                        help="--closed-loop: each new sequence submitted after a random delay up to this long "
                             "(default 0: at once, in whole waves)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if not (args.engine_only or args.closed_loop) and args.tokenizer is None:
        parser.error("--tokenizer is needed to serve (or pass --engine-only)")
    if args.closed_loop and (args.engine_only or args.no_engine or args.soak or args.profile_gil):
        parser.error("--closed-loop runs alone: leave out --engine-only / --no-engine / --soak / --profile-gil")
    if args.jitter_ms and not args.closed_loop:
        parser.error("--jitter-ms spreads the arrivals of --closed-loop; pass --closed-loop too")
    if args.stream_levels is not None and (args.engine_only or args.closed_loop or args.soak):
        parser.error("--stream-levels sets the served streamed cells; leave out --engine-only / --closed-loop / --soak")
    if args.levels is not None and (args.engine_only or args.closed_loop or args.soak):
        parser.error("--levels sets the served non-streamed cells; leave out --engine-only / --closed-loop / --soak")
    args.stream_levels = args.stream_levels or (16, 64)
    args.levels = (1, 16, 64) if args.levels is None else args.levels
    if args.profile_gil:  # checked before minutes of cells, not after them
        if args.engine_only or args.soak:
            parser.error("--profile-gil samples the served cells' model: leave out --engine-only / --soak")
        if not set(args.profile_of) <= set(PROFILES):
            parser.error(f"--profile-of: expected some of {', '.join(PROFILES)}")
        args.py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(args.py_spy).is_file():
            parser.error("--profile-gil needs py-spy (pip install py-spy) in this environment")

    import torch

    report = {"command": "python benchmarks/serve_gpu.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)", "torch": torch.__version__, "shapes": {}}
    print(json.dumps({k: report[k] for k in ("gpu", "torch")}), flush=True)
    if args.soak:
        report["soak"] = soak(args)
        if args.json_out:
            args.json_out.write_text(json.dumps(report, indent=2, default=str))
        return 0
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"forge-gpu-{shape}-") as scratch:
            root = Path(scratch)
            model_dir = make_model(shape, args.tokenizer, root / "model", args.dtype)
            if args.closed_loop:
                report["shapes"][shape] = {"closed_loop": closed_loop(model_dir, args.dtype, jitter_ms=args.jitter_ms),
                                           "prefill": prefill_ms(model_dir, args.dtype)}
                if args.json_out:
                    args.json_out.write_text(json.dumps(report, indent=2, default=str))
                continue
            entry = {} if args.engine_only else serve(shape, model_dir, root, args)
            if not args.no_engine:
                entry.update(engine_report(shape, model_dir, args.dtype, args.bandwidth_tbs))
            entry["served_share"] = served_share(entry)
            report["shapes"][shape] = entry
            if args.json_out:  # after every shape: a run cut short keeps what it measured
                args.json_out.write_text(json.dumps(report, indent=2, default=str))
    return 0


def serve(shape: str, model_dir: Path, root: Path, args) -> dict:
    """forge's default build and the hf-pipeline model in one tritonserver: greedy check, closed-loop load."""
    from transformers import AutoTokenizer

    from forge.loadgen.runner import format_table
    from forge.server.triton_server import TritonServer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    manifest = build(model_dir, root / "default", "--target", "python", "--dtype", args.dtype,
                     *args.forge_args.split())
    repo = root / "repo"
    shutil.copytree(root / "default", repo, ignore=shutil.ignore_patterns("forge-manifest.json"))
    if not args.no_seed:
        build(model_dir, root / "seed", "--target", "hf-pipeline", "--dtype", args.dtype, "--name-prefix", "seed_")
        shutil.copytree(root / "seed" / "seed_ensemble", repo / "seed_ensemble")
    runtime = find_note(manifest, "python_target").get("runtime", {})
    rows, served_dtype = [], runtime.get("on_this_machine", {}).get("compute_dtype", args.dtype)
    started = time.perf_counter()
    with TritonServer(repo, startup_timeout=900) as server, _log_tail_on_failure(server):
        startup_s = round(time.perf_counter() - started, 1)
        print(f"{shape}: tritonserver ready in {startup_s} s (every model loaded, the decoders' warm-up included)",
              flush=True)
        greedy = check_greedy(server, model_dir, tokenizer, served_dtype)
        print(f"{shape}: served greedy ids vs transformers ({served_dtype}): {json.dumps(greedy)}", flush=True)
        for name, model, levels, stream in (("forge default build", "tensorrt_llm", args.levels, False),
                                            ("forge default build, streamed", "tensorrt_llm", args.stream_levels, True),
                                            ("seed-000 hf-pipeline", "seed_ensemble", () if args.no_seed else (1, 16),
                                             False)):
            engine_model = None if name.startswith("seed") else model
            for c in levels:
                count = max(2 * c, 8) if name.startswith("seed") else args.waves * c
                summary = load(server, model, tokenizer, c, count, args.max_tokens, stream=stream,
                               engine_model=engine_model, processes=args.client_processes if stream else 1)
                summary.update({"run": f"{shape} {name}, c={c}", "concurrency": c, "server": name})
                rows.append(summary)
                print(f"  {summary['run']}: {summary['tokens_per_s']:.1f} tok/s; engine "
                      f"{json.dumps({k: v for k, v in summary.items() if k.startswith(('engine_', 'sender_'))})}; "
                      f"Triton ms per request {json.dumps(summary['triton_ms'])}; CPU cores busy "
                      f"{json.dumps(summary['cpu_cores'])}, the client's {summary['client_cores']}", flush=True)
        gil = {of: profile_gil(server, tokenizer, args, of) for of in args.profile_of} if args.profile_gil else None
    print(format_table(rows, label="run"))
    print(f"{shape}: forge default build chose {json.dumps(runtime)}")
    by = {(r["server"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    seed = by.get(("seed-000 hf-pipeline", 16))
    ratio = by[("forge default build", 16)] / seed if seed and ("forge default build", 16) in by else None
    if ratio is not None:
        print(f"{shape}: forge default / seed-000 model generated tok/s at concurrency 16: {ratio:.1f}x")
    return {"greedy": greedy, "rows": rows, "ratio_c16": ratio, "runtime": runtime, "startup_s": startup_s,
            **({"gil_profile": gil} if gil else {})}


@contextlib.contextmanager
def _log_tail_on_failure(server, lines: int = 60):
    """A failed cell prints the end of tritonserver's log (a crashed server says why there)."""
    try:
        yield
    except Exception:
        log = server.log_file.read_text(errors="replace").splitlines() if server.log_file else []
        print(f"tritonserver log ({server.log_file}), last {lines} lines:", *log[-lines:], sep="\n", flush=True)
        raise


def _thread_kind(frames: list[str]) -> str:
    """py-spy's raw stacks start with ``thread (id): name``: the engine, a sender, ``execute`` (on the stub's
    main thread) or the thread's name (the main thread's own C++ work has no Python frame)."""
    name = frames[0].partition(": ")[2]
    if name.startswith(("forge-decoder", "forge-sender")):
        return "engine" if name == "forge-decoder" else "sender"
    return "execute" if any(".execute (" in f for f in frames) else name or "other"


#: What ``--profile-of`` samples: the process (the tensorrt_llm model's stub or its engine process), under which
#: closed-loop load (model, concurrency, streamed)
PROFILES = {"stub": ("tensorrt_llm", False, "tensorrt_llm", 64, False),
            "engine": ("tensorrt_llm", True, "tensorrt_llm", 64, False),
            "stub-streamed": ("tensorrt_llm", False, "tensorrt_llm", 16, True),
            "engine-streamed": ("tensorrt_llm", True, "tensorrt_llm", 16, True)}


def profile_gil(server, tokenizer, args, of: str = "stub", top: int = 25) -> dict:
    """``--profile-gil`` seconds of ``py-spy record --gil`` (samples of the thread holding the GIL) on one served
    process under closed-loop load (``PROFILES[of]``): each thread's share of the samples and the functions (own
    time and with what they call) holding it most."""
    import collections
    import subprocess
    import threading

    from forge.server.supervisor import stub_processes

    model, engine, ensemble, concurrency, stream = PROFILES[of]
    pid = next((p for p, name in stub_processes(server).items() if name == model), None)
    if pid is None:
        raise RuntimeError(f"no python-backend process serves {model}")
    if engine:  # the stub's child running the engine (-o engine_process)
        from forge.server.processes import engine_processes, session_processes

        pid = next((engine for engine, stub in engine_processes(session_processes(server.process.pid)).items()
                    if stub == pid), None)
        if pid is None:
            raise RuntimeError(f"{model} runs its engine inside its stub: no engine process to profile")
    out = Path(tempfile.mkdtemp(prefix="forge-gil-")) / "gil.txt"
    stop = threading.Event()

    def drive() -> None:
        while not stop.is_set():
            load(server, ensemble, tokenizer, concurrency, 4 * concurrency, args.max_tokens, stream=stream)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    time.sleep(2)
    done = subprocess.run([args.py_spy, "record", "--pid", str(pid), "--gil", "--threads", "--rate", "200", "--duration",
                           str(int(args.profile_gil)), "--format", "raw", "--output", str(out)],
                          capture_output=True, text=True)
    stop.set()
    driver.join()
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    threads, own, inclusive, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        total += n
        threads[_thread_kind(frames)] += n
        own[frames[-1]] += n
        for frame in {f.rpartition(":")[0] + ")" for f in frames[1:]}:  # per function (without the line)
            inclusive[frame] += n
    share = {k: round(v / total, 3) for k, v in threads.most_common()}
    held = round(total / (200 * args.profile_gil), 3)  # samples are taken only while some thread holds the GIL
    report = {"of": of, "pid": pid, "samples": total, "seconds": args.profile_gil, "concurrency": concurrency,
              "streamed": stream,
              "gil_held_share": held, "thread_share": share,
              "own": [(f, round(n / total, 3)) for f, n in own.most_common(top)],
              "inclusive": [(f, round(n / total, 3)) for f, n in inclusive.most_common(top)],
              "collapsed": str(out)}
    print(f"  {of}: GIL held {held:.0%} of the time under c={concurrency}; by thread (of {total} samples): "
          f"{json.dumps(share)}", flush=True)
    for title, rows in (("own", report["own"]), ("inclusive", report["inclusive"])):
        print(f"  GIL held, top functions ({title}):", flush=True)
        for frame, part in rows:
            print(f"    {part:6.1%}  {frame[:160]}", flush=True)
    return report


def kernel_log() -> list[str]:
    """Kernel log lines about crashed processes (segfaults, traps), where this machine lets us read them."""
    import subprocess

    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ["(kernel log not readable here)"]
    return [line for line in text.splitlines() if "segfault" in line or "traps:" in line or "general protection" in line]


def soak(args) -> dict:
    """Every shape's default build in one tritonserver; closed-loop load at ``--soak-concurrency`` on each
    model's ensemble at once for ``--soak`` seconds (each request bounded by ``--soak-timeout``: one that
    runs past it counts as hung), then a stop. Reports per model sent / succeeded / errors / hung, the
    server's exit status, crash lines in its log and new segfault lines in the kernel log."""
    import threading

    from transformers import AutoTokenizer

    from forge.loadgen import runner
    from forge.clients.inference import GrpcSession
    from forge.server.triton_server import TritonServer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    before = kernel_log()
    report = {"seconds": args.soak, "concurrency": args.soak_concurrency, "timeout_s": args.soak_timeout, "models": {}}
    with tempfile.TemporaryDirectory(prefix="forge-gpu-soak-") as scratch:
        root = Path(scratch)
        repo = root / "repo"
        repo.mkdir()
        for shape in args.shapes.split(","):
            model_dir = make_model(shape, args.tokenizer, root / f"model-{shape}", args.dtype)
            build(model_dir, root / shape, "--target", "python", "--dtype", args.dtype, "--name-prefix", f"{shape}_",
                  *args.forge_args.split())
            for part in (root / shape).iterdir():
                if part.is_dir():
                    shutil.copytree(part, repo / part.name)
        log = root / "tritonserver.log"
        server = TritonServer(repo, startup_timeout=900, log_file=log)
        server.start()
        end = time.monotonic() + args.soak

        def drive(shape: str) -> None:
            with GrpcSession(server.grpc_url) as session:
                inputs = session.config(f"{shape}_tensorrt_llm")
            target = runner.Target(inputs, stream=False, extra={"exclude_input": True},
                                  count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
            samples, rounds, started = [], 0, time.perf_counter()
            while time.monotonic() < end:
                items = runner.prompts(prompts(tokenizer, 16), 4 * args.soak_concurrency, args.max_tokens)
                got, _ = runner.run(server.grpc_url, target, items, concurrency=args.soak_concurrency,
                                   timeout_s=args.soak_timeout)
                samples += got
                rounds += 1
            wall = time.perf_counter() - started
            summary = runner.summarize(samples, wall)
            summary["hung"] = sum(1 for x in samples if x.error and ("timed out" in x.error.lower()
                                                                      or "deadline" in x.error.lower()))
            summary["rounds"] = rounds
            report["models"][shape] = summary
            print(f"  soak {shape}: {json.dumps({k: summary[k] for k in ('requests', 'succeeded', 'errors', 'hung', 'tokens_per_s', 'first_error')})}",
                  flush=True)

        drivers = [threading.Thread(target=drive, args=(shape,)) for shape in args.shapes.split(",")]
        for t in drivers:
            t.start()
        for t in drivers:
            t.join()
        stopped = time.monotonic()
        server.stop()
        report["stop_s"] = round(time.monotonic() - stopped, 2)
        report["exit_status"] = server.process.returncode
        text = log.read_text(errors="replace") if log.is_file() else ""
        report["log_crash_lines"] = [line for line in text.splitlines()
                                     if any(w in line for w in ("Segmentation fault", "segfault", "signal 11",
                                                                "is not healthy", "core dumped"))][:20]
    report["kernel_log_new"] = [line for line in kernel_log() if line not in before]
    print(f"soak: stop {report['stop_s']} s, exit status {report['exit_status']}, crash lines in the server log "
          f"{len(report['log_crash_lines'])}, new kernel-log crash lines {report['kernel_log_new']}", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(main())
