"""The python target's decoding step on a CPU, with forge's C kernels and without, in one process.

The real SmolLM2-135M-Instruct (bfloat16 where the CPU has bf16 matmuls), the engine the default build serves
(static decoder, packed GEMMs, one OpenMP team: the engine steps on a thread of its own), no Triton. For each row
count, sequences of ~32-token prompts are admitted and then stepped, switching every ``--switch`` steps between
the decoder's forms, so both see the same machine load and the same growing columns:
  * ``kernels``: attention, RMSNorm and the greedy picks through cpu_kernels' C library (the default on a CPU);
  * ``torch``: SDPA attention and torch's ops (what a CPU without a C compiler or AVX-512 runs).
Prints ms per step for each and their ratio, and writes the results table to ``--json-out`` (default
benchmarks/experiments/cpu_step-<date>.json).

    python benchmarks/cpu_step.py [--rows 1,8,32] [--rounds 12] [--switch 5] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "core" / "forge" / "in_triton" / "python_target"))
import gen_docs  # noqa: E402 - the results file shape the docs read


def measure(rows: list[int], rounds: int, switch: int) -> list[dict]:
    import torch
    import smollm2
    from forge_decoder import engine as engines
    from forge_decoder.request import GenerationRequest, Limits
    from forge_decoder.sequences import Sequence

    device = torch.device("cpu")
    dtype = engines.choose_dtype(device, "auto", "bfloat16")
    torch.set_num_threads(engines.choose_threads(device, 0, dtype))
    model = engines.load_model(smollm2.hf_dir(), device, dtype)
    results = []
    for n in rows:
        engine = engines.Engine(model, Limits(vocab_size=model.config.vocab_size, max_input_len=512, max_seq_len=2048),
                                max_rows=max(rows))
        chosen = engine.use_graphs("auto", compile="auto", paged="auto", reuse=False, memory_fraction=None,
                                   overlap="auto")
        decoder = engine.graphs
        library = decoder.cpu_kernel
        if library is None:
            sys.exit(f"cpu_step: the C kernels do not run here ({chosen})")
        steps = rounds * switch
        engine.submit([Sequence(GenerationRequest(prompt=list(range(100 + i, 132 + i)), max_new_tokens=steps + 8),
                                lambda s, u: None) for i in range(n)])
        for _ in range(4):  # the prefill and a few warm steps
            engine.step()
        spent = {"kernels": 0.0, "torch": 0.0}
        for turn in range(rounds):
            form = ("kernels", "torch")[turn % 2]
            decoder.attention, decoder.cpu_kernel = ("cpu", library) if form == "kernels" else ("sdpa", None)
            started = time.perf_counter()
            for _ in range(switch):
                engine.step()
            spent[form] += time.perf_counter() - started
        decoder.attention, decoder.cpu_kernel = "cpu", library
        engine.run_until_idle()
        per = {form: round(1000 * seconds / (rounds // 2 * switch), 2) for form, seconds in spent.items()}
        results.append({"rows": n, "kernels_ms_per_step": per["kernels"], "torch_ms_per_step": per["torch"],
                        "ratio": round(per["kernels"] / per["torch"], 3), "dtype": str(dtype).removeprefix("torch."),
                        "threads": torch.get_num_threads()})
        print(f"  {n:3d} rows: kernels {per['kernels']:.1f} ms/step, torch {per['torch']:.1f} ms/step "
              f"({per['kernels'] / per['torch']:.2f}x)", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=lambda text: [int(n) for n in text.split(",")], default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=12, help="turns, alternating the two forms (even)")
    parser.add_argument("--switch", type=int, default=5, help="steps per turn")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        parser.error("--rounds must be an even number of at least 2")
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(rows=measure(args.rows, args.rounds, args.switch)))
    worker.start()  # the engine's own thread, as served: one OpenMP team (see loading.load_apart)
    worker.join()
    if "rows" not in box:
        return 1
    measured = box["rows"]
    print(json.dumps(measured))
    first = measured[0]
    gen_docs.write_results(
        "cpu_step", out=args.json_out, title="The python target's decoding step on a CPU",
        machine_line=f"{platform.machine()}, {os.cpu_count()} cores, {first['dtype']}, {first['threads']} torch threads",
        description="SmolLM2-135M-Instruct, the engine alone (no Triton); the C kernels (attention, RMSNorm, greedy "
                    f"picks) and torch's ops (SDPA) alternated every {args.switch} steps in one process.",
        columns=["rows", "C kernels ms/step", "torch ops ms/step", "C kernels / torch"],
        rows=[[r["rows"], r["kernels_ms_per_step"], r["torch_ms_per_step"], r["ratio"]] for r in measured],
        measured=measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
