"""GPU serving benchmark: forge's DEFAULT python-target build vs seed 000's model (``--target hf-pipeline``).

For each model shape (random weights, seeded; the tokenizer of SmolLM2):
  1. ``forge build --target python`` (nothing else) and ``forge build --target hf-pipeline`` (float16),
     served together by one real tritonserver through ``forge serve``'s launcher;
  2. correctness: greedy ids of the served ``tensorrt_llm`` model vs transformers ``generate`` on the
     same GPU in the served dtype (first divergence reported);
  3. closed-loop load through each ensemble: ~32-token prompts, 64 new tokens, concurrency 1 / 16 / 64
     (the pipeline at 1 and 16), generated tokens counted with the tokenizer in the returned text;
     and streamed through a ``--decoupled`` build of the same model at 16 and 64 (time to first token,
     inter-token latency);
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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_decoder import find_note  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above an old quiet "
         "harbour town where sailors tell long stories about distant islands and forgotten treasure").split()
SHAPES = {  # Llama shapes; the vocabulary is SmolLM2's so its tokenizer serves both
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8),  # Llama-3-8B's layers (SmolLM2's vocabulary: ~7.2B parameters)
}


LONG_CONTEXT = ("tinyllama",)  # shapes whose engine report has the max_seq_len 8192 × 64 rows cells


SMOLLM2 = dict(vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
               max_position_embeddings=8192)


def make_model(shape: str, tokenizer: Path | None, out: Path, dtype: str = "float16") -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if shape == "gpt2":  # GPT-2 small's shape (124M, its own 50257-token vocabulary): the engine alone only
        if tokenizer is not None:
            sys.exit("benchmark: the gpt2 shape has no tokenizer here; use it with --engine-only")
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(torch_dtype=dtype)).to(getattr(torch, dtype)).save_pretrained(out)
        return out

    base = json.loads((tokenizer / "config.json").read_text()) if tokenizer else SMOLLM2
    config = LlamaConfig(**{**{k: base[k] for k in ("vocab_size", "rms_norm_eps", "rope_theta", "bos_token_id",
                                                   "eos_token_id", "max_position_embeddings") if k in base},
                            **SHAPES[shape], "tie_word_embeddings": True, "torch_dtype": dtype})
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a 7B model initialises in seconds on a GPU
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    if tokenizer is None:
        return out
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja"):
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, out / name)
    return out


def build(model_dir: Path, out: Path, *extra: str) -> dict:
    from forge.cli import main

    argv = ["build", "--family", "llama", "--model", str(model_dir), "--out", str(out), *extra]
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
    """Served greedy ids vs transformers generate on this GPU, same prompt, same dtype."""
    import numpy as np
    import torch
    import tritonclient.grpc as grpc
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode(prompts(tokenizer, 1)[0], add_special_tokens=True)
    client = grpc.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, value in (("input_ids", np.array([ids], np.int32)), ("input_lengths", np.array([[len(ids)]], np.int32)),
                        ("request_output_len", np.array([[n]], np.int32))):
        tensor = grpc.InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    served = client.infer("tensorrt_llm", inputs).as_numpy("output_ids").reshape(-1).tolist()[len(ids):]
    client.close()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).cuda().eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"), pad_token_id=0)
    reference = out[0, len(ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(served, reference)) if a != b), min(len(served), len(reference)))
    del model
    torch.cuda.empty_cache()
    return {"dtype": dtype, "tokens": n, "equal_prefix": same, "served": served[:8], "transformers": reference[:8]}


def load(server, model: str, tokenizer, concurrency: int, requests: int, max_tokens: int,
         stream: bool = False, engine_model: str | None = None, processes: int = 1) -> dict:
    """One closed-loop cell after two warm-up waves at the cell's concurrency (the decoder captures a prefill graph
    the first time a batch of prompts of its size arrives; that one-time capture is the warm-up's, recorded as
    ``warmup_s``, not the cell's); with ``engine_model``, what its engine did in the cell.
    With ``processes`` > 1 the clients are split over that many client processes (one Python's GIL can be
    what limits a streamed cell: every response is parsed by the client), started together."""
    from forge.loadgen import workload

    target = _target(server.grpc_url, model, tokenizer, stream)
    items = workload.prompts(prompts(tokenizer, 16), requests, max_tokens)
    warmup = time.perf_counter()
    workload.run(server.grpc_url, target, items[:2 * concurrency], concurrency=concurrency)
    warmup_s = round(time.perf_counter() - warmup, 2)
    before, models_before = engine_counters(server, engine_model), model_durations(server)
    cpu_before, client_before = process_cpu(server), _client_cpu()
    processes = max(1, min(processes, concurrency))  # at most one process per client
    if processes > 1:
        samples = _in_processes(server.grpc_url, model, tokenizer.name_or_path, stream, items, concurrency, processes)
        wall = max(s.done for s in samples) - min(s.sent for s in samples)
    else:
        samples, wall = workload.run(server.grpc_url, target, items, concurrency=concurrency)
    return {**workload.summarize(samples, wall), **engine_share(before, engine_counters(server, engine_model), wall),
            "triton_ms": per_request_ms(models_before, model_durations(server)), "client_processes": processes,
            "cpu_cores": cores_busy(cpu_before, process_cpu(server), wall),
            "client_cores": round((_client_cpu() - client_before) / wall, 2) if wall else None, "warmup_s": warmup_s}


def _client_cpu() -> float:
    """CPU seconds of this process and its finished children (the client processes of a cell, once joined)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _target(url: str, model: str, tokenizer, stream: bool):
    from forge.loadgen import workload
    from forge.clients.inference import GrpcSession

    with GrpcSession(url) as session:
        inputs = session.config(model)
    return workload.Target(inputs, stream=stream, extra={"exclude_input_in_output": True},
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

    from forge.loadgen import workload

    target = _target(url, model, AutoTokenizer.from_pretrained(tokenizer_dir), stream)
    ready.wait(600)
    samples, _ = workload.run(url, target, items, concurrency=concurrency)
    results.put(samples)


def process_cpu(server) -> dict[tuple, float]:
    """CPU seconds used so far by each thread of the server's session (Linux /proc), keyed (role, thread id,
    thread name); roles: ``tritonserver``, each python model's stub (its model name), ``<model> engine`` (an engine
    process, by its stub's model), ``other``."""
    from forge.server.triton_server import engine_processes, session_processes
    from forge.server.supervisor import stub_processes

    if server.process is None:
        return {}
    pids = session_processes(server.process.pid)
    ticks, stubs, engines = os.sysconf("SC_CLK_TCK"), stub_processes(server), engine_processes(pids)
    used: dict[tuple, float] = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        if pid == server.process.pid:
            role = "tritonserver"
        elif pid in stubs:
            role = stubs[pid]
        elif pid in engines:
            role = f"{stubs.get(engines[pid], '?')} engine"
        else:
            role = "other"
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp session … utime(11) stime(12)
            name = stat[stat.index("(") + 1:stat.rfind(")")]
            used[(role, int(task.name), name)] = (int(fields[11]) + int(fields[12])) / ticks
    return used


def cores_busy(before: dict[tuple, float], after: dict[tuple, float], wall_s: float) -> dict[str, dict]:
    """Each role's CPU time between two ``process_cpu`` snapshots per second of the cell (1.0: one core kept busy
    the whole time; the Python threads of one process share one GIL) and its busiest thread's (name and cores):
    a thread near 1.0 is what the role waits on."""
    if wall_s <= 0:
        return {}
    roles: dict[str, dict] = {}
    for key, seconds in after.items():
        busy = (seconds - before.get(key, 0.0)) / wall_s
        role = roles.setdefault(key[0], {"cores": 0.0, "busiest_thread": None, "busiest_cores": 0.0})
        role["cores"] += busy
        if busy > role["busiest_cores"]:
            role["busiest_thread"], role["busiest_cores"] = key[2], busy
    return {role: {k: round(v, 2) if isinstance(v, float) else v for k, v in entry.items()}
            for role, entry in sorted(roles.items(), key=lambda kv: -kv[1]["cores"]) if entry["cores"] >= 0.005}


#: Triton's per-model counters (microseconds summed over requests) that split a request's time
DURATIONS = ("request_duration", "queue_duration", "compute_input_duration", "compute_infer_duration",
             "compute_output_duration")


def model_durations(server) -> dict[str, dict[str, float]]:
    """Each model's Triton counters: successful requests and the summed durations of DURATIONS (µs)."""
    import re
    import urllib.request

    url = server.metrics_url if "://" in server.metrics_url else f"http://{server.metrics_url}"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, dict[str, float]] = {}
    for name, labels, value in re.findall(r'^nv_inference_(\w+?)(?:_us)?\{([^}]*)\} (\S+)$', text, re.M):
        model = re.search(r'model="([^"]+)"', labels)
        if model and (name in DURATIONS or name == "request_success"):
            entry = found.setdefault(model.group(1), {})
            entry[name] = entry.get(name, 0.0) + float(value)
    return found


def per_request_ms(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Mean ms per successful request of each model that served requests between two snapshots: the time
    Triton counted in its queue, in the model (compute_infer: for a model answering through its response
    sender, until ``execute`` returned) and in all (request)."""
    out = {}
    for model, now in after.items():
        then = before.get(model, {})
        done = now.get("request_success", 0) - then.get("request_success", 0)
        if done > 0:
            out[model] = {"requests": int(done), **{key.replace("_duration", ""): round(
                (now.get(key, 0) - then.get(key, 0)) / done / 1000, 3) for key in DURATIONS}}
    return out


def timed_steps(engine, steps: int, warm: int = 3) -> tuple[float, float | None]:
    """(ms per engine step, the device's ms per step or None) over ``steps`` steps, after ``warm`` steps (the first
    decoding steps capture); the device's time is measured (CUDA events) only through CUDA graphs."""
    import torch

    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()
    device = engine.device_ns
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1000
    return ms, (engine.device_ns - device) / steps / 1e6 if engine.timed else None


def engine_steps(model_dir: Path, dtype: str, rows_list=(1, 16, 64), steps: int = 32,
                 forms=(("false", None, "false", "false", "auto"), ("true", "sdpa", "false", "false", "auto"),
                        ("true", "sdpa", "auto", "false", "auto"), ("true", "auto", "auto", "false", "auto"),
                        ("true", "auto", "auto", "false", "false"), ("true", "auto", "false", "true", "auto"))
                 ) -> list[dict]:
    """Decode ms/step of forge's engine alone at each row count (prompts of 32 tokens), per step form:
    ``-o cuda_graphs=false`` (the Hugging Face forward) and ``true`` (CUDA graphs over the static KV cache)
    with an attention form of graphs.ATTENTION (``auto``, the default: the one the decoder chose is recorded), its
    layers eager or compiled (``-o torch_compile``; the
    seconds ``use_graphs`` took, compiling included, are ``setup_s``), its KV cache static or paged
    (``-o paged_kv_cache``), each step launched before the last is read or one at a time (``-o overlap_steps``).
    ``device_ms_per_step``: the GPU's time per step (CUDA events), where the steps are captured."""
    import torch

    from forge.in_triton.python_target.forge_decoder import graphs
    from forge.in_triton.python_target.forge_decoder.engine import Engine, Sequence, load_model
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    default = graphs.ATTENTION
    results = []
    for mode, attention, compiled, paged, overlap in forms:
        graphs.ATTENTION = attention or default
        for rows in rows_list:
            engine = Engine(model, Limits(model.config.vocab_size, 512, 1024), max_rows=rows)
            setup = time.perf_counter()
            chosen = engine.use_graphs(mode, compile=compiled, paged=paged, overlap=overlap)
            setup = time.perf_counter() - setup
            engine.submit([Sequence(GenerationRequest(list(range(100 + i, 132 + i)), steps + 8), lambda s, u: None)
                           for i in range(rows)])
            with torch.inference_mode():
                engine.step()  # prefill
                ms, device_ms = timed_steps(engine, steps)
            used = engine.graphs.attention if engine.graphs is not None else None  # what auto chose
            results.append({"cuda_graphs": mode, "attention": used, "attention_asked": graphs.ATTENTION,
                            "torch_compile": compiled,
                            "paged_kv_cache": paged, "overlap_steps": overlap, "chosen": chosen,
                            "setup_s": round(setup, 1), "rows": rows, "ms_per_step": round(ms, 3),
                            "device_ms_per_step": None if device_ms is None else round(device_ms, 3),
                            "tokens_per_s": round(rows / ms * 1000, 1)})
            print(f"  engine alone, cuda_graphs={mode} attention={attention}→{used} torch_compile={compiled} "
                  f"paged_kv_cache={paged} overlap_steps={overlap}, {rows} rows: "
                  f"{ms:.3f} ms/step, device {device_ms} ms ({chosen}; set up in {setup:.1f} s)", flush=True)
            del engine
    graphs.ATTENTION = default
    del model
    torch.cuda.empty_cache()
    return [dict(r, weight_bytes=weights) for r in results]


def closed_loop(model_dir: Path, dtype: str, concurrency=(16, 64), waves: int = 16, max_tokens: int = 64,
                length: int = 32, jitter_ms: float = 0.0) -> list[dict]:
    """The engine alone loaded as the served cells load the server: ``c`` sequences in flight, each one that
    finishes replaced by a new prompt of ``length`` tokens, until ``waves`` × c have finished. ``jitter_ms`` 0: the
    replacement is submitted at once from the engine's callback (arrivals in whole waves); else after a random
    delay up to that long, from a timer thread (arrivals spread out, as a server's clients send them). Its
    default form (CUDA graphs, compiled, overlapped steps), with prefills joining the step in flight
    (``engine.JOIN_PREFILLS``) and with each prefill waiting for it (the default). What the engine makes with
    admissions, between ``engine_steps`` (steps alone) and the served cells."""
    import random
    import threading

    import torch

    from forge.in_triton.python_target.forge_decoder import engine as engine_mod
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits

    model = engine_mod.load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    results, default = [], engine_mod.JOIN_PREFILLS
    for join in (True, False):
        engine_mod.JOIN_PREFILLS = join
        for c in concurrency:
            engine = engine_mod.Engine(model, Limits(model.config.vocab_size, 512, 1024), max_rows=max(c, 64))
            chosen = engine.use_graphs("auto")
            total, made, ended, live, done = waves * c, [0], [0], [False], threading.Event()
            delays = random.Random(c)

            def finished(seq, update):
                if not update.finished or not live[0]:
                    return
                ended[0] += 1
                if made[0] < total:
                    made[0] += 1
                    if jitter_ms:
                        threading.Timer(delays.random() * jitter_ms / 1000, engine.submit, [[new(made[0])]]).start()
                    else:
                        engine.submit([new(made[0])])
                elif ended[0] == total:
                    done.set()

            def new(i):
                seq = engine_mod.Sequence(GenerationRequest([100 + (i + k) % 5000 for k in range(length)],
                                                            max_tokens), finished)
                sequences.append(seq)
                return seq

            sequences = []
            engine.submit([new(i) for i in range(c)])  # a warm-up wave: buckets captured, compiled pieces ready
            with torch.inference_mode():
                engine.run_until_idle()
            sequences.clear()
            before = {k: getattr(engine, k) for k in ("step_ns", "prefill_ns", "prefills", "joined", "admitted",
                                                       "decode_steps", "decoded_rows", "device_ns", "wait_ns")}
            made[0], live[0] = c, True
            engine.start()
            started = time.perf_counter()
            engine.submit([new(i) for i in range(c)])
            done.wait(timeout=300)
            wall = time.perf_counter() - started
            engine.stop()
            delta = {k: getattr(engine, k) - v for k, v in before.items()}
            tokens = sum(len(s.output) for s in sequences)
            steps = delta["decode_steps"] or 1
            row = {"join_prefills": join, "concurrency": c, "jitter_ms": jitter_ms, "sequences": len(sequences),
                   "chosen": chosen,
                   "tokens_per_s": round(tokens / wall, 1), "ms_per_step": round(wall / steps * 1000, 3),
                   "device_ms_per_step": round(delta["device_ns"] / steps / 1e6, 3),
                   "prefill_share": round(delta["prefill_ns"] / wall / 1e9, 3),
                   "admitted_per_prefill": round(delta["admitted"] / max(delta["prefills"], 1), 2),
                   "joined_share": round(delta["joined"] / max(delta["admitted"], 1), 3),
                   "mean_rows": round(delta["decoded_rows"] / steps, 1)}
            results.append(row)
            print(f"  engine alone, closed loop, c={c}, arrivals jittered up to {jitter_ms} ms, "
                  f"prefills {'join' if join else 'wait'}: "
                  f"{row['tokens_per_s']} tok/s, {row['ms_per_step']} ms/step (device {row['device_ms_per_step']}), "
                  f"prefill share {row['prefill_share']}, {row['admitted_per_prefill']} prompts a prefill, "
                  f"{row['mean_rows']} rows", flush=True)
            del engine
    engine_mod.JOIN_PREFILLS = default
    del model
    torch.cuda.empty_cache()
    return results


def long_context(model_dir: Path, dtype: str, rows: int = 64, max_len: int = 8192, steps: int = 32,
                 prompt_lengths=(32, 2000)) -> list[dict]:
    """The engine alone at ``max_len`` tokens per sequence with ``rows`` rows: which KV layout
    ``-o paged_kv_cache=auto`` chooses on this GPU (and its ms/step), beside each layout forced, for prompts
    of each length."""
    import torch

    from forge.in_triton.python_target.forge_decoder.engine import Engine, Sequence, load_model
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    out = []
    for paged in ("auto", "true", "false"):
        for length in prompt_lengths:
            engine = Engine(model, Limits(model.config.vocab_size, max_len - steps - 16, max_len), max_rows=rows)
            try:
                chosen = engine.use_graphs("true", paged=paged)
            except ValueError as exc:
                out.append({"paged_kv_cache": paged, "rows": rows, "max_seq_len": max_len, "prompt": length,
                            "refused": str(exc)})
                print(f"  long context, paged_kv_cache={paged}: {exc}", flush=True)
                del engine
                continue
            engine.submit([Sequence(GenerationRequest([100 + (i + j) % 4000 for j in range(length)], steps + 8),
                                    lambda s, u: None) for i in range(rows)])
            with torch.inference_mode():
                torch.cuda.synchronize()
                start = time.perf_counter()
                idle = 0  # steps that admitted nothing: the engine gathers arrivals, or the cache is full
                while engine._pending and idle < 64:  # admissions (prefills) until every row runs or none can
                    before = len(engine._active)
                    engine.step()
                    idle = 0 if len(engine._active) > before else idle + 1
                torch.cuda.synchronize()
                prefill = time.perf_counter() - start
                running = len(engine._active)  # the rows measured (all of them unless admission stopped)
                ms, _device_ms = timed_steps(engine, steps)
            row = {"paged_kv_cache": paged, "rows": rows, "max_seq_len": max_len, "prompt": length, "chosen": chosen,
                   "running": running, "admit_s": round(prefill, 2), "ms_per_step": round(ms, 3),
                   "tokens_per_s": round(running / ms * 1000, 1),
                   "gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
            out.append(row)
            print(f"  long context: {json.dumps(row)}", flush=True)
            del engine
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    del model
    torch.cuda.empty_cache()
    return out


def kernels_per_step(model_dir: Path, dtype: str) -> dict:
    """CUDA kernels one decoding step launches (the static decoder run eagerly at 1 row: what a graph replays),
    per attention form, from the profiler; and the kernels of a prefill of one 32-token prompt, layers eager and
    compiled (the step's attention form does not touch the prefill), with the most frequent kernel names of the
    default form's step and prefill (where the next kernels to fuse are)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    from forge.in_triton.python_target.forge_decoder import graphs
    from forge.in_triton.python_target.forge_decoder.engine import load_model

    def kernels(run) -> list[str]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                and not e.name.lower().startswith(("memcpy", "memset"))]

    def top(names: list[str]) -> list[list]:
        return [[name[:80], n] for name, n in collections.Counter(names).most_common(12)]

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    default, counts, prefill, names = graphs.ATTENTION, {}, {}, {}
    prompt = torch.arange(100, 132)[None]  # on the host, as the engine passes it
    for attention, compiled in (("matmul", False), ("sdpa", False), ("sdpa", True), ("fused", False), ("fused", True)):
        graphs.ATTENTION = attention
        decoder = graphs.decoder_for(model, 1, 1024, capture=False)
        if compiled:
            try:
                decoder.use_compile("true")  # the count's decoder is not captured: auto would stay eager
            except ValueError as exc:
                print(f"  {exc}", flush=True)
                continue
        form = attention + ("+compile" if compiled else "")
        with torch.inference_mode():
            decoder.prefill(prompt, [32])
            decoder.step([5], [32])
            step = kernels(lambda: decoder.step([6], [33]))
            counts[form] = len(step)
            if attention == "fused":
                decoder.reset()
                first = kernels(lambda: decoder.prefill(prompt, [32]))
                prefill["compiled" if compiled else "eager"] = len(first)
                if compiled:
                    names = {"step": top(step), "prefill": top(first)}
        del decoder
    graphs.ATTENTION = default
    layers = int(model.config.num_hidden_layers)
    del model
    torch.cuda.empty_cache()
    print(f"  kernels per decoding step (1 row): {counts} over {layers} layers; per prefill (1 x 32): {prefill}",
          flush=True)
    for what, common in names.items():
        print(f"  most frequent kernels, fused+compile {what}: {common}", flush=True)
    return {"layers": layers, "kernels": counts, "prefill_kernels": prefill, "most_frequent": names}


def prefill_ms(model_dir: Path, dtype: str, counts=(1, 16, 64), length: int = 32, repeats: int = 5) -> list[dict]:
    """ms to prefill ``count`` prompts of ``length`` tokens at once: the static decoder's own prefill (fused,
    keys/values into the slots), captured as a CUDA graph and eager, vs the Hugging Face forward the engine
    used before (and still uses without the static cache)."""
    import torch

    from forge.in_triton.python_target.forge_decoder import graphs, kvcache
    from forge.in_triton.python_target.forge_decoder.engine import load_model

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    eager = graphs.decoder_for(model, max(counts), 1024, capture=False)
    captured = graphs.decoder_for(model, max(counts), 1024)
    compiled = graphs.decoder_for(model, max(counts), 1024)
    compiled.use_compile("auto")
    out = []
    with torch.inference_mode():
        for n in counts:
            ids = torch.arange(length)[None] + 100 + torch.arange(n)[:, None]  # on the host, as the engine passes them
            timings, device = {}, []
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for form in ("graph", "compiled", "static", "hf"):
                for i in range(repeats + 1):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    if form != "hf":
                        decoder = {"graph": captured, "compiled": compiled, "static": eager}[form]
                        decoder.reset()
                        decoder.prefill(ids, [length] * n)
                    else:
                        gpu_ids = ids.cuda()
                        model(input_ids=gpu_ids, attention_mask=torch.ones_like(gpu_ids),
                              past_key_values=kvcache.new_cache(), use_cache=True, logits_to_keep=1)
                    torch.cuda.synchronize()
                    if i:  # the first is a warm-up
                        timings.setdefault(form, []).append((time.perf_counter() - start) * 1000)
                        if form == "compiled":  # the device alone: the same graph replayed again, launched at once
                            graph = decoder.prefill_graphs[decoder._prefill_bucket(n, length)][0]
                            events[0].record()
                            graph.replay()
                            events[1].record()
                            events[1].synchronize()
                            device.append(events[0].elapsed_time(events[1]))
            row = {"prompts": n, "tokens": length, "graph_ms": round(min(timings["graph"]), 3),
                   "compiled_graph_ms": round(min(timings["compiled"]), 3),
                   "compiled_graph_device_ms": round(min(device), 3),
                   "static_ms": round(min(timings["static"]), 3), "hf_forward_ms": round(min(timings["hf"]), 3)}
            out.append(row)
            print(f"  prefill of {n} × {length} tokens: static, captured {row['graph_ms']} ms (layers compiled: "
                  f"{row['compiled_graph_ms']} ms, of which the device {row['compiled_graph_device_ms']} ms); "
                  f"static, eager {row['static_ms']} ms; Hugging Face forward {row['hf_forward_ms']} ms", flush=True)
    del eager, captured, compiled, decoder, model
    torch.cuda.empty_cache()
    return out


def engine_parity(model_dir: Path, dtype: str, rows: int = 8, n: int = 64) -> dict:
    """Greedy ids of the engine with CUDA graphs (``rows`` sequences of different prompts, joining two
    steps apart) vs transformers ``generate`` of each prompt alone, same GPU and dtype: the shortest
    equal prefix over the rows and how many rows agree on all ``n`` tokens."""
    import torch

    from forge.in_triton.python_target.forge_decoder.engine import Engine, Sequence, load_model
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    prompts_ = [[(7 * i + 13 * j) % 4000 + 50 for j in range(20 + 3 * i)] for i in range(rows)]
    engine = Engine(model, Limits(model.config.vocab_size, 512, 1024), max_rows=rows)
    chosen = engine.use_graphs("true")
    seqs = [Sequence(GenerationRequest(p, n), lambda s, u: None) for p in prompts_]
    with torch.inference_mode():
        for seq in seqs:
            engine.submit([seq])
            engine.step()
            engine.step()
        engine.run_until_idle()
        prefixes = []
        for seq, prompt in zip(seqs, prompts_):
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
            prefixes.append(next((i for i, (a, b) in enumerate(zip(seq.output, out)) if a != b), n))
    del engine, model
    torch.cuda.empty_cache()
    return {"dtype": dtype, "cuda_graphs": chosen, "rows": rows, "tokens": n, "min_equal_prefix": min(prefixes),
            "rows_all_equal": sum(p == n for p in prefixes)}


def hf_generate_rate(model_dir: Path, dtype: str, n: int = 64) -> float:
    """Tokens/s of plain transformers ``generate`` at one row (what a per-request model does)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).cuda().eval()
    model.generation_config.eos_token_id = None
    ids = torch.arange(100, 132, device="cuda")[None]
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    del model
    torch.cuda.empty_cache()
    return n / (time.perf_counter() - start)


def engine_report(shape: str, model_dir: Path, dtype: str, bandwidth_tbs: float) -> dict:
    """The engine alone: parity in float32 and ``dtype``, ms/step per mode and rows, the bandwidth floor."""
    parity = [engine_parity(model_dir, d) for d in ("float32", dtype)]
    for p in parity:
        print(f"{shape}: greedy ids, engine with CUDA graphs vs transformers generate: {json.dumps(p)}", flush=True)
    rate = hf_generate_rate(model_dir, dtype)
    print(f"{shape}: transformers generate alone, 1 row, {dtype}: {rate:.1f} tok/s", flush=True)
    kernels = kernels_per_step(model_dir, dtype)
    prefill = prefill_ms(model_dir, dtype)
    steps = engine_steps(model_dir, dtype)
    long = long_context(model_dir, dtype) if shape in LONG_CONTEXT else []
    for s in steps:
        s["bandwidth_floor_ms"] = round(s["weight_bytes"] / (bandwidth_tbs * 1e12) * 1000, 3)
        s["x_above_floor"] = round(s["ms_per_step"] / s["bandwidth_floor_ms"], 1)
        print(f"  engine alone, cuda_graphs={s['cuda_graphs']}, {s['rows']} rows: {s['ms_per_step']} ms/step, "
              f"{s['tokens_per_s']} tok/s; weights {s['weight_bytes'] / 1e6:.0f} MB → bandwidth floor "
              f"{s['bandwidth_floor_ms']} ms ({s['x_above_floor']}× above it)", flush=True)
    return {"parity": parity, "generate_tokens_per_s": round(rate, 1), "engine": steps, "kernels_per_step": kernels,
            "prefill": prefill, "long_context": long}


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
                        "process), both under c=64 non-streamed load, or stub-streamed / engine-streamed (the "
                        "--decoupled build's, under c=16 streamed load)")
    parser.add_argument("--stream-levels", type=lambda text: tuple(int(c) for c in text.split(",")),
                        help="the streamed cells' concurrencies (default 16,64)")
    parser.add_argument("--levels", type=lambda text: tuple(int(c) for c in text.split(",") if c),
                        help="the served non-streamed cells' concurrencies (default 1,16,64; empty: none)")
    parser.add_argument("--closed-loop", action="store_true",
                        help="only the engine alone in a closed loop, prefills joining steps and not (closed_loop)")
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
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
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

    from forge.loadgen.workload import format_table
    from forge.server.triton_server import TritonServer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    manifest = build(model_dir, root / "default", "--target", "python", "--dtype", args.dtype,
                     *args.forge_args.split())
    repo = root / "repo"
    shutil.copytree(root / "default", repo, ignore=shutil.ignore_patterns("forge-manifest.json"))
    build(model_dir, root / "stream", "--target", "python", "--dtype", args.dtype, "--decoupled", "--name-prefix", "d_",
          *args.forge_args.split())
    for part in (root / "stream").iterdir():
        if part.is_dir():
            shutil.copytree(part, repo / part.name)
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
        for name, model, levels, stream in (("forge default build", "ensemble", args.levels, False),
                                            ("forge --decoupled build, streamed", "d_ensemble", args.stream_levels, True),
                                            ("seed-000 hf-pipeline", "seed_ensemble", () if args.no_seed else (1, 16),
                                             False)):
            engine_model = None if name.startswith("seed") else model.replace("ensemble", "tensorrt_llm")
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


#: What ``--profile-of`` samples: the process (the tensorrt_llm model's stub or its engine process) of which
#: build, under which closed-loop load (model, concurrency, streamed)
PROFILES = {"stub": ("tensorrt_llm", False, "ensemble", 64, False),
            "engine": ("tensorrt_llm", True, "ensemble", 64, False),
            "stub-streamed": ("d_tensorrt_llm", False, "d_ensemble", 16, True),
            "engine-streamed": ("d_tensorrt_llm", True, "d_ensemble", 16, True)}


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
        from forge.server.triton_server import engine_processes, session_processes

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


def engine_counters(server, model: str | None) -> dict[str, float]:
    """The served engine's own counters (forge_decoder_engine_total) and its senders' (forge_decoder_responses_total,
    as ``sender_<kind>``) from the metrics endpoint."""
    import re
    import urllib.request

    if model is None:
        return {}
    with urllib.request.urlopen(f"http://{server.metrics_url}" if "://" not in server.metrics_url
                                else server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for family, prefix in (("forge_decoder_engine_total", ""), ("forge_decoder_responses_total", "sender_")):
        for kind, value in re.findall(r'%s\{[^}]*kind="(\w+)"[^}]*model="%s"[^}]*\} (\S+)'
                                      % (family, re.escape(model)), text) + re.findall(
                r'%s\{[^}]*model="%s"[^}]*kind="(\w+)"[^}]*\} (\S+)' % (family, re.escape(model)), text):
            found[prefix + kind] = float(value)
    return found


def engine_share(before: dict, after: dict, wall_s: float) -> dict:
    """What the engine thread did during a load cell: the share of the wall time inside its steps, its mean
    batch and ms per decoding step (the rest of the time it waited for requests)."""
    if not before or not after or not wall_s:
        return {}
    steps = after["decode_steps"] - before["decode_steps"]
    busy = after["step_seconds"] - before["step_seconds"]
    admitted = after.get("admitted", 0) - before.get("admitted", 0)
    extra = {}
    if admitted:
        extra = {"engine_queued_ms": round((after["queued_seconds"] - before["queued_seconds"]) / admitted * 1000, 3),
                 "engine_prefill_share": round((after["prefill_seconds"] - before["prefill_seconds"]) / busy, 3)
                 if busy else None}
        prefills = after.get("prefills", 0) - before.get("prefills", 0)
        if prefills:  # a server from before these counters has neither
            extra["engine_admitted_per_prefill"] = round(admitted / prefills, 2)
            extra["engine_joined_share"] = round((after["joined"] - before.get("joined", 0)) / admitted, 3)
    if steps and "device_seconds" in after:  # CUDA graphs: the device's share of a step, and the wait for it
        for kind in ("device", "wait"):
            spent = after[f"{kind}_seconds"] - before.get(f"{kind}_seconds", 0.0)
            extra[f"engine_{kind}_ms_per_step"] = round(spent / steps * 1000, 3)
    responses = after.get("sender_responses", 0) - before.get("sender_responses", 0)
    if responses:  # the stub's sender threads: per response, and their threads kept busy (of sender_threads)
        for kind in ("build", "send"):
            spent = after[f"sender_{kind}_seconds"] - before.get(f"sender_{kind}_seconds", 0.0)
            extra[f"sender_{kind}_ms"] = round(spent / responses * 1000, 3)
            extra[f"sender_{kind}_threads"] = round(spent / wall_s, 2)
        extra["sender_responses_per_s"] = round(responses / wall_s, 1)
    return {**extra, "engine_busy": round(busy / wall_s, 3),
            "engine_mean_rows": round((after["decoded_rows"] - before["decoded_rows"]) / steps, 1) if steps else None,
            "engine_ms_per_step": round(busy / steps * 1000, 3) if steps else None}


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

    from forge.loadgen import workload
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
                inputs = session.config(f"{shape}_ensemble")
            target = workload.Target(inputs, stream=False, extra={"exclude_input_in_output": True},
                                  count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
            samples, rounds, started = [], 0, time.perf_counter()
            while time.monotonic() < end:
                items = workload.prompts(prompts(tokenizer, 16), 4 * args.soak_concurrency, args.max_tokens)
                got, _ = workload.run(server.grpc_url, target, items, concurrency=args.soak_concurrency,
                                   timeout_s=args.soak_timeout)
                samples += got
                rounds += 1
            wall = time.perf_counter() - started
            summary = workload.summarize(samples, wall)
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
