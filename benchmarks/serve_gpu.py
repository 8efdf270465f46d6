"""GPU serving benchmark: forge's DEFAULT python-target build vs seed 000's model (``--target hf-pipeline``).

For each model shape (random weights, seeded; the tokenizer of SmolLM2):
  1. ``forge build --target python`` (nothing else) and ``forge build --target hf-pipeline`` (float16),
     served together by one real tritonserver through ``forge serve``'s launcher;
  2. correctness: greedy ids of the served ``tensorrt_llm`` model vs transformers ``generate`` on the
     same GPU in the served dtype (first divergence reported);
  3. closed-loop load through each ensemble: ~32-token prompts, 64 new tokens, concurrency 1 / 16 / 64
     (the pipeline at 1 and 16), generated tokens counted with the tokenizer in the returned text;
  4. the engine alone (no Triton): decode ms/step at 1 / 16 / 64 rows, and the distance to the
     memory-bandwidth limit (weight bytes per step / the GPU's bandwidth).

    python benchmarks/serve_gpu.py --tokenizer DIR [--shapes smollm2,tinyllama] [--bandwidth-tbs 3.35]
    python benchmarks/serve_gpu.py --engine-only [--shapes smollm2,tinyllama,gpt2]  # 4. alone: no tritonserver
"""

from __future__ import annotations

import argparse
import json
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
}


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
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
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


def load(server, model: str, tokenizer, concurrency: int, requests: int, max_tokens: int) -> dict:
    from forge.serving import bench
    from forge.serving.client import GrpcSession

    with GrpcSession(server.grpc_url) as session:
        inputs = session.config(model)
    target = bench.Target(inputs, stream=False, extra={"exclude_input_in_output": True},
                          count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    items = bench.prompts(prompts(tokenizer, 16), requests, max_tokens)
    bench.run(server.grpc_url, target, items[:2], concurrency=1)  # warm-up
    samples, wall = bench.run(server.grpc_url, target, items, concurrency=concurrency)
    return bench.summarize(samples, wall)


def engine_steps(model_dir: Path, dtype: str, rows_list=(1, 16, 64), steps: int = 32,
                 modes=("false", "true")) -> list[dict]:
    """Decode ms/step of forge's engine alone at each row count (prompts of 32 tokens), per ``-o cuda_graphs``
    mode: ``false`` the Hugging Face forward, ``true`` the CUDA graphs over the static KV cache."""
    import torch

    from forge.served.decoder_engine.forge_decoder.engine import Engine, Sequence, load_model
    from forge.served.decoder_engine.forge_decoder.request import GenerationRequest, Limits

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    results = []
    for mode in modes:
        for rows in rows_list:
            engine = Engine(model, Limits(model.config.vocab_size, 512, 1024), max_rows=rows)
            engine.use_graphs(mode)
            engine.submit([Sequence(GenerationRequest(list(range(100 + i, 132 + i)), steps + 8), lambda s, u: None)
                           for i in range(rows)])
            with torch.inference_mode():
                engine.step()  # prefill
                for _ in range(3):
                    engine.step()  # the first decoding steps capture the graphs
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / steps * 1000
            results.append({"cuda_graphs": mode, "rows": rows, "ms_per_step": round(ms, 3),
                            "tokens_per_s": round(rows / ms * 1000, 1)})
            print(f"  engine alone, cuda_graphs={mode}, {rows} rows: {ms:.3f} ms/step", flush=True)
            del engine
    del model
    torch.cuda.empty_cache()
    return [dict(r, weight_bytes=weights) for r in results]


def engine_parity(model_dir: Path, dtype: str, rows: int = 8, n: int = 64) -> dict:
    """Greedy ids of the engine with CUDA graphs (``rows`` sequences of different prompts, joining two
    steps apart) vs transformers ``generate`` of each prompt alone, same GPU and dtype: the shortest
    equal prefix over the rows and how many rows agree on all ``n`` tokens."""
    import torch

    from forge.served.decoder_engine.forge_decoder.engine import Engine, Sequence, load_model
    from forge.served.decoder_engine.forge_decoder.request import GenerationRequest, Limits

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
    steps = engine_steps(model_dir, dtype)
    for s in steps:
        s["bandwidth_floor_ms"] = round(s["weight_bytes"] / (bandwidth_tbs * 1e12) * 1000, 3)
        s["x_above_floor"] = round(s["ms_per_step"] / s["bandwidth_floor_ms"], 1)
        print(f"  engine alone, cuda_graphs={s['cuda_graphs']}, {s['rows']} rows: {s['ms_per_step']} ms/step, "
              f"{s['tokens_per_s']} tok/s; weights {s['weight_bytes'] / 1e6:.0f} MB → bandwidth floor "
              f"{s['bandwidth_floor_ms']} ms ({s['x_above_floor']}× above it)", flush=True)
    return {"parity": parity, "generate_tokens_per_s": round(rate, 1), "engine": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a SmolLM2 directory (config + tokenizer); needed to serve")
    parser.add_argument("--shapes", default="smollm2,tinyllama")
    parser.add_argument("--dtype", default="float16", help="the build's --dtype")
    parser.add_argument("--requests", type=int, default=64, help="requests per forge load point (≥ concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="the GPU's memory bandwidth, TB/s")
    parser.add_argument("--forge-args", default="", help="extra forge build arguments (default: none, the default build)")
    parser.add_argument("--no-seed", action="store_true", help="skip the hf-pipeline model (measured before)")
    parser.add_argument("--engine-only", action="store_true", help="only the engine alone (no tritonserver)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if not args.engine_only and args.tokenizer is None:
        parser.error("--tokenizer is needed to serve (or pass --engine-only)")

    import torch

    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
    print(json.dumps({k: report[k] for k in ("gpu", "torch")}), flush=True)
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"forge-gpu-{shape}-") as scratch:
            root = Path(scratch)
            model_dir = make_model(shape, args.tokenizer, root / "model", args.dtype)
            entry = {} if args.engine_only else serve(shape, model_dir, root, args)
            entry.update(engine_report(shape, model_dir, args.dtype, args.bandwidth_tbs))
            report["shapes"][shape] = entry
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2, default=str))
    return 0


def serve(shape: str, model_dir: Path, root: Path, args) -> dict:
    """forge's default build and the hf-pipeline model in one tritonserver: greedy check, closed-loop load."""
    from transformers import AutoTokenizer

    from forge.serving.bench import format_table
    from forge.serving.server import TritonServer

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
    with TritonServer(repo, startup_timeout=900) as server:
        greedy = check_greedy(server, model_dir, tokenizer, served_dtype)
        print(f"{shape}: served greedy ids vs transformers ({served_dtype}): {json.dumps(greedy)}", flush=True)
        for name, model, levels in (("forge default build", "ensemble", (1, 16, 64)),
                                    ("seed-000 hf-pipeline", "seed_ensemble", () if args.no_seed else (1, 16))):
            for c in levels:
                count = max(2 * c, 8) if name.startswith("seed") else max(args.requests, c)
                summary = load(server, model, tokenizer, c, count, args.max_tokens)
                summary.update({"run": f"{shape} {name}, c={c}", "concurrency": c, "server": name})
                rows.append(summary)
                print(f"  {summary['run']}: {summary['tokens_per_s']:.1f} tok/s", flush=True)
    print(format_table(rows, label="run"))
    print(f"{shape}: forge default build chose {json.dumps(runtime)}")
    by = {(r["server"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    seed = by.get(("seed-000 hf-pipeline", 16))
    ratio = by[("forge default build", 16)] / seed if seed else None
    if ratio is not None:
        print(f"{shape}: forge default / seed-000 model generated tok/s at concurrency 16: {ratio:.1f}x")
    return {"greedy": greedy, "rows": rows, "ratio_c16": ratio, "runtime": runtime}


if __name__ == "__main__":
    sys.exit(main())
