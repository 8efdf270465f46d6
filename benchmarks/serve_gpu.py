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


def make_model(shape: str, tokenizer: Path, out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((tokenizer / "config.json").read_text())
    config = LlamaConfig(**{**{k: base[k] for k in ("vocab_size", "rms_norm_eps", "rope_theta", "bos_token_id",
                                                   "eos_token_id", "max_position_embeddings") if k in base},
                            **SHAPES[shape], "tie_word_embeddings": True, "torch_dtype": "float16"})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(out)
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


def engine_steps(model_dir: Path, dtype: str, rows_list=(1, 16, 64), steps: int = 32) -> list[dict]:
    """Decode ms/step of forge's engine alone at each row count (prompts of 32 tokens)."""
    import torch

    from forge.served.decoder_engine.forge_decoder.engine import Engine, Sequence, load_model
    from forge.served.decoder_engine.forge_decoder.request import GenerationRequest, Limits

    model = load_model(model_dir, torch.device("cuda"), getattr(torch, dtype))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    results = []
    for rows in rows_list:
        engine = Engine(model, Limits(model.config.vocab_size, 512, 1024), max_rows=rows)
        engine.submit([Sequence(GenerationRequest(list(range(100, 132)), steps + 8), lambda s, u: None)
                       for _ in range(rows)])
        with torch.inference_mode():
            engine.step()  # prefill
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / steps * 1000
        results.append({"rows": rows, "ms_per_step": round(ms, 2), "tokens_per_s": round(rows / ms * 1000, 1)})
    del model
    torch.cuda.empty_cache()
    return [dict(r, weight_bytes=weights) for r in results]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a SmolLM2 directory (config + tokenizer)")
    parser.add_argument("--shapes", default="smollm2,tinyllama")
    parser.add_argument("--requests", type=int, default=64, help="requests per forge load point (≥ concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="the GPU's memory bandwidth, TB/s")
    parser.add_argument("--forge-args", default="", help="extra forge build arguments (default: none, the default build)")
    parser.add_argument("--no-seed", action="store_true", help="skip the hf-pipeline model (measured before)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from forge.serving.bench import format_table
    from forge.serving.server import TritonServer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"forge-gpu-{shape}-") as scratch:
            root = Path(scratch)
            model_dir = make_model(shape, args.tokenizer, root / "model")
            manifest = build(model_dir, root / "default", "--target", "python", *args.forge_args.split())
            repo = root / "repo"
            shutil.copytree(root / "default", repo, ignore=shutil.ignore_patterns("forge-manifest.json"))
            if not args.no_seed:
                build(model_dir, root / "seed", "--target", "hf-pipeline", "--name-prefix", "seed_")
                shutil.copytree(root / "seed" / "seed_ensemble", repo / "seed_ensemble")
            runtime = find_note(manifest, "python_target").get("runtime", {})
            rows, served_dtype = [], runtime.get("on_this_machine", {}).get("compute_dtype", "float16")
            with TritonServer(repo, startup_timeout=900) as server:
                greedy = check_greedy(server, model_dir, tokenizer, served_dtype)
                print(f"{shape}: greedy ids vs transformers ({served_dtype}): {json.dumps(greedy)}", flush=True)
                for name, model, levels in (("forge default build", "ensemble", (1, 16, 64)),
                                            ("seed-000 hf-pipeline", "seed_ensemble", () if args.no_seed else (1, 16))):
                    for c in levels:
                        count = max(2 * c, 8) if name.startswith("seed") else max(args.requests, c)
                        summary = load(server, model, tokenizer, c, count, args.max_tokens)
                        summary.update({"run": f"{shape} {name}, c={c}", "concurrency": c, "server": name})
                        rows.append(summary)
                        print(f"  {summary['run']}: {summary['tokens_per_s']:.1f} tok/s", flush=True)
            steps = engine_steps(model_dir, served_dtype)
            for s in steps:
                s["bandwidth_floor_ms"] = round(s["weight_bytes"] / (args.bandwidth_tbs * 1e12) * 1000, 3)
                s["x_above_floor"] = round(s["ms_per_step"] / s["bandwidth_floor_ms"], 1)
            print(format_table(rows, label="run"))
            print(f"{shape}: forge default build chose {json.dumps(runtime)}")
            for s in steps:
                print(f"  engine alone, {s['rows']} rows: {s['ms_per_step']} ms/step, {s['tokens_per_s']} tok/s; "
                      f"weights {s['weight_bytes'] / 1e6:.0f} MB → bandwidth floor {s['bandwidth_floor_ms']} ms "
                      f"({s['x_above_floor']}× above it)")
            by = {(r["server"], r["concurrency"]): r["tokens_per_s"] for r in rows}
            seed = by.get(("seed-000 hf-pipeline", 16))
            ratio = by[("forge default build", 16)] / seed if seed else None
            if ratio is not None:
                print(f"{shape}: forge default / seed-000 model generated tok/s at concurrency 16: {ratio:.1f}x")
            report["shapes"][shape] = {"greedy": greedy, "rows": rows, "engine": steps, "ratio_c16": ratio,
                                       "runtime": runtime}
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
