"""The engine alone on a GPU (no Triton): serve_gpu.py's fourth leg (``--engine-only``) and ``--closed-loop``.

Decode ms/step at 1 / 16 / 64 rows per step form (Hugging Face forward; CUDA graphs with each attention form,
layers eager or compiled, KV cache static or paged, steps overlapped or one at a time), the distance to the
memory-bandwidth limit, kernels per decoding step and per prefill, prefill ms (the static decoder's own prefill vs
the Hugging Face forward), greedy parity with transformers ``generate``, long-context KV layouts, and the engine
loaded in a closed loop as the served cells load a server.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_shapes import free_gpu  # serve_gpu.py, which runs these legs, puts benchmarks/ on sys.path

LONG_CONTEXT = ("tinyllama",)  # shapes whose engine report has the max_seq_len 8192 × 64 rows cells


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
    from forge.in_triton.python_target.forge_decoder.engine import Engine, load_model
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits
    from forge.in_triton.python_target.forge_decoder.sequences import Sequence

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
    free_gpu()
    return [dict(r, weight_bytes=weights) for r in results]


def closed_loop(model_dir: Path, dtype: str, concurrency=(16, 64), waves: int = 16, max_tokens: int = 64,
                length: int = 32, jitter_ms: float = 0.0) -> list[dict]:
    """The engine alone loaded as the served cells load the server: ``c`` sequences in flight, each one that
    finishes replaced by a new prompt of ``length`` tokens, until ``waves`` × c have finished. ``jitter_ms`` 0: the
    replacement is submitted at once from the engine's callback (arrivals in whole waves); else after a random
    delay up to that long, from a timer thread (arrivals spread out, as a server's clients send them). Its
    default form (CUDA graphs, compiled, overlapped steps; each prefill waits for the step in flight). What the
    engine makes with admissions, between ``engine_steps`` (steps alone) and the served cells."""
    import random
    import threading

    import torch

    from forge.in_triton.python_target.forge_decoder import engine as engine_mod
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits
    from forge.in_triton.python_target.forge_decoder.sequences import Sequence

    model = engine_mod.load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    results = []
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
            seq = Sequence(GenerationRequest([100 + (i + k) % 5000 for k in range(length)], max_tokens), finished)
            sequences.append(seq)
            return seq

        sequences = []
        engine.submit([new(i) for i in range(c)])  # a warm-up wave: buckets captured, compiled pieces ready
        with torch.inference_mode():
            engine.run_until_idle()
        sequences.clear()
        before = {k: getattr(engine, k) for k in ("step_ns", "prefill_ns", "prefills", "admitted", "decode_steps",
                                                   "decoded_rows", "device_ns", "wait_ns")}
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
        row = {"concurrency": c, "jitter_ms": jitter_ms, "sequences": len(sequences), "chosen": chosen,
               "tokens_per_s": round(tokens / wall, 1), "ms_per_step": round(wall / steps * 1000, 3),
               "device_ms_per_step": round(delta["device_ns"] / steps / 1e6, 3),
               "prefill_share": round(delta["prefill_ns"] / wall / 1e9, 3),
               "admitted_per_prefill": round(delta["admitted"] / max(delta["prefills"], 1), 2),
               "mean_rows": round(delta["decoded_rows"] / steps, 1)}
        results.append(row)
        print(f"  engine alone, closed loop, c={c}, arrivals jittered up to {jitter_ms} ms: "
              f"{row['tokens_per_s']} tok/s, {row['ms_per_step']} ms/step (device {row['device_ms_per_step']}), "
              f"prefill share {row['prefill_share']}, {row['admitted_per_prefill']} prompts a prefill, "
              f"{row['mean_rows']} rows", flush=True)
        del engine
    del model
    free_gpu()
    return results


def long_context(model_dir: Path, dtype: str, rows: int = 64, max_len: int = 8192, steps: int = 32,
                 prompt_lengths=(32, 2000)) -> list[dict]:
    """The engine alone at ``max_len`` tokens per sequence with ``rows`` rows: which KV layout
    ``-o paged_kv_cache=auto`` chooses on this GPU (and its ms/step), beside each layout forced, for prompts
    of each length."""
    import torch

    from forge.in_triton.python_target.forge_decoder.engine import Engine, load_model
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits
    from forge.in_triton.python_target.forge_decoder.sequences import Sequence

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
            free_gpu()
            torch.cuda.reset_peak_memory_stats()
    del model
    free_gpu()
    return out


def kernels_per_step(model_dir: Path, dtype: str) -> dict:
    """CUDA kernels one decoding step launches (the static decoder run eagerly at 1 row: what a graph replays),
    per attention form, from the profiler; and the kernels of a prefill of one 32-token prompt, layers eager and
    compiled (the step's attention form does not touch the prefill), with the most frequent kernel names of the
    default form's step and prefill (where the next kernels to fuse are)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    from forge.in_triton.python_target.forge_decoder import architectures, graphs
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
        decoder = architectures.decoder_for(model, 1, 1024, capture=False)
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
    free_gpu()
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

    from forge.in_triton.python_target.forge_decoder import architectures, kvcache
    from forge.in_triton.python_target.forge_decoder.engine import load_model

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    eager = architectures.decoder_for(model, max(counts), 1024, capture=False)
    captured = architectures.decoder_for(model, max(counts), 1024)
    compiled = architectures.decoder_for(model, max(counts), 1024)
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
    free_gpu()
    return out


def engine_parity(model_dir: Path, dtype: str, rows: int = 8, n: int = 64) -> dict:
    """Greedy ids of the engine with CUDA graphs (``rows`` sequences of different prompts, joining two
    steps apart) vs transformers ``generate`` of each prompt alone, same GPU and dtype: the shortest
    equal prefix over the rows and how many rows agree on all ``n`` tokens."""
    import torch

    from forge.in_triton.python_target.forge_decoder.engine import Engine, load_model
    from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits
    from forge.in_triton.python_target.forge_decoder.sequences import Sequence

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
    free_gpu()
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
    free_gpu()
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
