"""The vllm target against vLLM's own OpenAI server and forge's default build: tokens/s and first-token time.

One machine, one run, the same load on each server: the real
SmolLM2-135M-Instruct built (a) ``--target python`` (forge's default CPU build) and (b) ``--target vllm``, each
served by ``forge serve`` (Triton + forge's OpenAI front), and (c) vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server``, from ``FORGE_VLLM_PYTHON``) on the same checkpoint and engine
arguments as (b). Each is loaded through ``POST /v1/completions``: a closed loop of C requests in flight for
--duration seconds, prompts of ~32 tokens, greedy, ``max_tokens`` 64 with ``ignore_eos`` (every answer is 64
tokens), tokens counted from each response's ``usage``; then one streamed cell at c=8 for the first token's
time (p50). All servers stay up and take turns cell by cell (the others idle meanwhile, the order reversed every
other cell), after a warm-up cell at the highest concurrency on each (not counted). Start-up is the time from
launching the server to its first answer, each started alone; peak RSS sums the server's process tree.

    FORGE_VLLM_PYTHON=VENV/bin/python python benchmarks/vllm_target.py [--concurrency 1,8,32] [--duration 20]
        [--eager] [--servers python,vllm,vllm-server] (python-hf: the python target with -o cuda_graphs=false)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402 - the results file shape the docs read

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years presses "
        "were running in more than two hundred European cities, books became cheaper, literacy spread, and ideas "
        "about science, religion and politics travelled faster than ever before. Historians still argue about how "
        "much of the scientific revolution and the reformation the new machines made possible.")
PROMPT_TOKENS = 32
LABELS = {"python": "forge --target python", "python-hf": "forge --target python, Hugging Face forward",
          "vllm": "forge --target vllm", "vllm-server": "vLLM's own server"}
#: what each forge server is built with (python-hf: the default build's decoder switched to the HF forward)
BUILDS = {"python": ("python", []), "python-hf": ("python", ["-o", "cuda_graphs=false"]), "vllm": ("vllm", [])}


def prompts(tokenizer, count: int = 16) -> list[str]:
    """``count`` different prompts of about PROMPT_TOKENS tokens (windows of TEXT)."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    step = max(1, (len(ids) - PROMPT_TOKENS) // count)
    return [tokenizer.decode(ids[i * step:i * step + PROMPT_TOKENS]) for i in range(count)]


def engine_options(args) -> list[str]:
    options = ["-o", f"max_model_len={args.max_model_len}", "-o", f"kv_cache_memory_bytes={args.kv_cache_bytes}"]
    return options + (["-o", "enforce_eager=true"] if args.eager else [])


def build(model: Path, out: Path, target: str, args, options: list[str] = ()) -> Path:
    from forge.cli import main

    extra = (engine_options(args) if target == "vllm" else []) + list(options)
    argv = ["build", "--family", "llama", "--model", str(model), "--target", target, "--out", str(out), *extra]
    print("$ forge " + " ".join(argv), flush=True)
    if main(argv) != 0:
        sys.exit("benchmark: forge build failed")
    return out


class Server:
    """A server process and its OpenAI base URL, ready once a completion comes back."""

    def __init__(self, argv: list[str], base: str, model: str, log: Path, env: dict[str, str]):
        print("$ " + " ".join(argv), flush=True)
        self.base, self.model, self.log = base, model, open(log, "w")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.peak_rss = 0  # bytes: the most its process tree held at once, sampled every 0.5 s
        self._sampling = threading.Thread(target=self._sample, daemon=True)
        self._sampling.start()

    def _sample(self) -> None:
        from forge.server.processes import descendants

        page = os.sysconf("SC_PAGE_SIZE")
        while self.process.poll() is None:
            total = 0
            for pid in [self.process.pid, *descendants(self.process.pid)]:
                try:
                    total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
                except (OSError, IndexError, ValueError):
                    continue
            self.peak_rss = max(self.peak_rss, total)
            time.sleep(0.5)

    def wait_ready(self, timeout: float) -> float:
        import httpx

        body = {"model": self.model, "prompt": "Hello", "max_tokens": 1}
        while time.perf_counter() - self.started < timeout:
            if self.process.poll() is not None:
                sys.exit(f"benchmark: the server exited ({self.process.returncode}); see {self.log.name}")
            try:
                if httpx.post(f"{self.base}/completions", json=body, timeout=30).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(1)
        sys.exit(f"benchmark: the server was not ready within {timeout:g} s; see {self.log.name}")

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=90)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


async def cell(server: Server, texts: list[str], *, concurrency: int, duration: float, max_tokens: int,
               stream: bool) -> dict:
    """Closed loop: ``concurrency`` workers send the prompts in turn until ``duration`` has passed."""
    import httpx

    tokens, ttft, errors, sent = [], [], [], [0]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        started = time.perf_counter()

        async def one(prompt: str) -> None:
            body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            t0 = time.perf_counter()
            if not stream:
                response = await client.post(f"{server.base}/completions", json=body)
                data = response.json()
                if response.status_code != 200:
                    raise RuntimeError(str(data))
                tokens.append(data["usage"]["completion_tokens"])
                return
            body.update(stream=True, stream_options={"include_usage": True})
            first, count = None, None
            async with client.stream("POST", f"{server.base}/completions", json=body) as response:
                async for line in response.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if first is None and any(c.get("text") for c in event.get("choices", [])):
                        first = time.perf_counter() - t0
                    if event.get("usage"):
                        count = event["usage"]["completion_tokens"]
            ttft.append(first)
            tokens.append(count or 0)

        async def worker(index: int) -> None:
            while time.perf_counter() - started < duration:
                prompt = texts[sent[0] % len(texts)]
                sent[0] += 1
                try:
                    await one(prompt)
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    errors.append(str(exc)[:200])

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    firsts = [t for t in ttft if t is not None]
    return {"tokens_per_s": sum(tokens) / elapsed, "requests": len(tokens), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "ttft_p50_ms": float(np.percentile(firsts, 50)) * 1000 if firsts else None}


def measure(servers: dict[str, Server], texts: list[str], args) -> dict[str, dict]:
    """Every cell on every server, the servers taking turns cell by cell (the order reversed every other cell,
    the others idle meanwhile), after a warm-up cell at the highest concurrency on each (not counted)."""
    for server in servers.values():
        asyncio.run(cell(server, texts, concurrency=max(args.concurrency), duration=min(args.duration, 10),
                         max_tokens=args.max_tokens, stream=False))
    loads = [(f"c={c}", c, False) for c in args.concurrency] + [("stream c=8", 8, True)]
    results: dict[str, dict] = {name: {} for name in servers}
    for turn, (key, concurrency, stream) in enumerate(loads):
        for name in (list(servers) if turn % 2 == 0 else list(servers)[::-1]):
            results[name][key] = asyncio.run(cell(servers[name], texts, concurrency=concurrency,
                                                  duration=args.duration, max_tokens=args.max_tokens, stream=stream))
            print(f"  {LABELS[name]}, {key}: {results[name][key]}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--eager", action="store_true", help="vLLM without compiled graphs (faster start)")
    parser.add_argument("--servers", default="python,vllm,vllm-server")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/experiments/)")
    args = parser.parse_args()
    vllm_python = os.environ.get("FORGE_VLLM_PYTHON")
    if not vllm_python:
        sys.exit("benchmark: set FORGE_VLLM_PYTHON to the Python of the vLLM environment (scripts/vllm_env.py)")
    import smollm2
    from transformers import AutoTokenizer

    from forge.server.processes import free_ports

    model = smollm2.hf_dir()
    texts = prompts(AutoTokenizer.from_pretrained(model))
    env = {**os.environ, "FORGE_VLLM_PYTHON": vllm_python}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if os.cpu_count() == 2 else "auto")
    work = Path(tempfile.mkdtemp(prefix="vllm-target-bench-"))
    startup: dict[str, float] = {}
    servers: dict[str, Server] = {}
    try:
        for name in args.servers.split(","):  # started one at a time: start-up is measured alone
            http, grpc, metrics, port = free_ports(4)
            if name == "vllm-server":
                repo = work / "vllm"  # the same checkpoint files and engine arguments as the vllm target's
                if not repo.exists():
                    build(model, repo, "vllm", args)
                doc = json.loads((repo / "ensemble" / "1" / "model.json").read_text())
                argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", doc["model"],
                        "--served-model-name", "smollm2", "--port", str(port), "--max-model-len",
                        str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
                argv += ["--enforce-eager"] if args.eager else []
            else:
                target, options = BUILDS[name]
                repo = build(model, work / name, target, args, options)
                argv = [sys.executable, "-m", "forge", "serve", str(repo), "--http-port", str(http), "--grpc-port",
                        str(grpc), "--metrics-port", str(metrics), "--openai-port", str(port),
                        "--served-model-name", "smollm2", "--startup-timeout", str(args.startup_timeout)]
            servers[name] = Server(argv, f"http://127.0.0.1:{port}/v1", "smollm2", work / f"{name}.log", env)
            startup[name] = servers[name].wait_ready(args.startup_timeout)
            print(f"{LABELS[name]}: ready in {startup[name]:.1f} s", flush=True)
        measured = measure(servers, texts, args)
    finally:
        for server in servers.values():
            server.stop()
    peak = {name: server.peak_rss for name, server in servers.items()}
    cells = [f"c={c}" for c in args.concurrency] + ["stream c=8"]
    ratios = [(forge, f"{forge} target / vLLM") for forge in ("python", "vllm")
              if forge in measured and "vllm-server" in measured]
    rows = []
    for key in cells:
        row = [f"completions {key}" if key.startswith("c=") else f"streamed completions {key[7:]}"]
        for name in measured:
            result = measured[name][key]
            text = f"{result['tokens_per_s']:.0f} tok/s"
            if result["ttft_p50_ms"] is not None:
                text += f", first token {result['ttft_p50_ms']:.0f} ms"
            row.append(text)
        vllm_rate = measured["vllm-server"][key]["tokens_per_s"] if ratios else 0
        row += [f"{measured[forge][key]['tokens_per_s'] / vllm_rate:.2f}" for forge, _ in ratios]
        rows.append(row)
    rows.append(["start-up to first answer", *(f"{startup[n]:.0f} s" for n in measured), *([""] * len(ratios))])
    rows.append(["peak RSS (the server's processes)", *(f"{peak[n] / 2**30:.1f} GiB" for n in measured),
                 *([""] * len(ratios))])
    columns = ["load", *(LABELS[n] for n in measured), *(label for _, label in ratios)]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU"
    gen_docs.write_results(
        "vllm_target", title="; ".join(LABELS[name] for name in measured) + " — on one CPU",
        columns=columns, rows=rows, machine_line=machine, out=args.out,
        description=f"SmolLM2-135M-Instruct (bf16), /v1/completions, prompts of ~{PROMPT_TOKENS} tokens, "
                    f"{args.max_tokens} tokens each (ignore_eos), greedy; closed loop for {args.duration:g} s per "
                    f"cell, the servers up together and taking turns cell by cell; vLLM "
                    f"{'eager' if args.eager else 'compiled'}, max_model_len {args.max_model_len}, "
                    f"KV cache {args.kv_cache_bytes >> 20} MiB",
        raw={name: measured[name] for name in measured}, startup_s=startup, peak_rss_bytes=peak)
    errors = sum(r["errors"] for m in measured.values() for r in m.values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
