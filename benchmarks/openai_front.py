"""What forge serve's OpenAI front costs, and what streaming by default costs: generated tokens/s and p50 TTFT,
Triton's generate endpoint vs /v1/completions, on the default build and on the same build not decoupled.

Builds the real SmolLM2-135M-Instruct with the default CPU build (``forge build --family llama --target
python``: the LLM-API layout, decoupled, so ``stream: true`` streams token by token) and the same with ``-o
decoupled=false``, serves each with ``forge serve --json`` (ports 0) and loads the one server through
  (a) Triton's generate endpoint: POST /v2/models/<generator>/generate (generate_stream for TTFT), and
  (b) the OpenAI front: POST /v1/completions (stream: true for TTFT),
with the same fixed prompts (raw text: completions apply no chat template), greedy (top_k 1 / temperature
0), the same max_tokens, the generated text only. The default build is measured non-streamed and streamed, the
other non-streamed: the front's cost (b / a), streaming's (streamed / non-streamed tokens/s) and the decoupled
model's on non-streamed requests (default / not decoupled).

Both sides use one client (httpx, one asyncio loop, closed loop of C in flight, in this process while
the server runs in its own) and count generated tokens the same way: the returned text, encoded by the
model's tokenizer after the cell. SSE lines are read as ``data: {json}`` for both sides alike, so client
overhead is identical (the openai client parses each chunk into pydantic models, which would bias (b)).
Cells alternate a, b, b, a … per concurrency to cancel drift (other load on the machine); each cell runs
for --duration seconds (requests in flight at the deadline finish and count).

    python benchmarks/openai_front.py [--concurrency 1,8,32] [--duration 15] [--repeats 2] [--max-tokens 32]
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
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gen_docs  # noqa: E402 - the results file shape the docs read
from serve_decoder import PROMPTS  # noqa: E402  (the same prompts as the serving benchmark)


def build(model_dir: Path, out: Path, *extra: str) -> Path:
    argv = ["build", "--family", "llama", "--model", str(model_dir), "--target", "python", "--out", str(out), *extra]
    print("$ forge " + " ".join(argv), flush=True)
    from forge.cli import main

    if main(argv) != 0:
        sys.exit("benchmark: forge build failed")
    return out


class Served:
    """``forge serve REPO --json`` in a subprocess; its endpoints once ready."""

    def __init__(self, repo: Path, log: Path):
        argv = [str(Path(sys.executable).with_name("forge")), "serve", str(repo), "--http-port", "0",
                "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0", "--json"]
        print("$ " + " ".join(["forge", *argv[1:]]), flush=True)
        self.log = open(log, "w")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
        text = ""
        while True:  # the json object is printed once every endpoint answers
            line = self.process.stdout.readline()
            if not line:
                sys.exit(f"benchmark: forge serve exited ({self.process.wait()}); see {log}")
            text += line
            try:
                self.info = json.loads(text)
                break
            except ValueError:
                continue
        self.http = self.info["http"].rstrip("/")
        if not self.http.startswith("http"):
            self.http = f"http://{self.http}"
        self.openai = self.info["openai"]
        self.model_id = self.info["openai_models"][0]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


# -- one cell: C requests in flight for a duration -------------------------------------------------------

async def _events(response):
    """The JSON objects of an SSE body (``data: {...}`` lines; ``[DONE]`` ends it)."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def _request(side: str, served: Served, inputs: set[str], prompt: str, max_tokens: int, stream: bool):
    if side == "generate":
        route = "generate_stream" if stream else "generate"
        if "sampling_param_max_tokens" in inputs:  # the LLM-API tensorrt_llm model (the default layout)
            body = {"text_input": prompt, "sampling_param_max_tokens": max_tokens, "sampling_param_top_k": 1,
                    "sampling_param_exclude_input_from_output": True}
            if stream:
                body["streaming"] = True
            return f"{served.http}/v2/models/tensorrt_llm/{route}", body
        body = {"text_input": prompt, "max_tokens": max_tokens, "top_k": 1}
        if "exclude_input_in_output" in inputs:
            body["exclude_input_in_output"] = True
        if stream and "stream" in inputs:
            body["stream"] = True
        return f"{served.http}/v2/models/ensemble/{route}", body
    body = {"model": served.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body["stream"] = True
    return f"{served.openai}/completions", body


def _text(side: str, event: dict) -> str:
    if "error" in event:
        raise RuntimeError(str(event["error"]))
    if side == "generate":
        return event.get("text_output", "")
    return "".join(choice.get("text") or "" for choice in event.get("choices", []))


async def cell(side: str, served: Served, inputs: set[str], *, concurrency: int, duration: float, max_tokens: int,
               stream: bool, at_least: int = 0) -> dict:
    """Closed loop: ``concurrency`` workers send the prompts in turn until ``duration`` has passed (and ``at_least``)."""
    import httpx

    texts, ttft, errors = [], [], []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        started = time.perf_counter()
        deadline = started + duration
        counter = iter(range(10 ** 9))

        async def worker() -> None:
            while True:
                number = next(counter)
                if time.perf_counter() >= deadline and number >= at_least:
                    return
                url, body = _request(side, served, inputs, PROMPTS[number % len(PROMPTS)], max_tokens, stream)
                sent = time.perf_counter()
                try:
                    if stream:
                        pieces, first = [], None
                        async with client.stream("POST", url, json=body) as response:
                            if response.status_code != 200:
                                raise RuntimeError(f"{response.status_code}: {(await response.aread())[:200]!r}")
                            async for event in _events(response):
                                piece = _text(side, event)
                                if piece and first is None:
                                    first = time.perf_counter() - sent
                                pieces.append(piece)
                        ttft.append(first)
                        texts.append("".join(pieces))
                    else:
                        response = await client.post(url, json=body)
                        if response.status_code != 200:
                            raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
                        data = response.json()
                        texts.append(_text(side, data) if side == "generate" else data["choices"][0]["text"])
                except Exception as exc:  # noqa: BLE001 - reported, never silently counted as tokens
                    errors.append(f"{type(exc).__name__}: {exc}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"texts": texts, "ttft": [t for t in ttft if t is not None], "errors": errors, "wall_s": wall}


def _ready(served: Served, inputs: set[str], max_tokens: int, stream: bool) -> None:
    """One request per side first (unmeasured): warm caches, and check both sides answer the same text."""
    got = {}
    for side in ("generate", "openai"):
        result = asyncio.run(cell(side, served, inputs, concurrency=1, duration=0.0, max_tokens=max_tokens,
                                  stream=stream, at_least=1))
        if result["errors"] or not result["texts"]:
            sys.exit(f"benchmark: {side} failed: {result['errors'][:1]}")
        got[side] = result["texts"][0]
    if got["generate"] != got["openai"]:
        print(f"warning: the two sides answered differently:\n  generate: {got['generate']!r}\n"
              f"  openai:   {got['openai']!r}", flush=True)


def _inputs(served: Served) -> set[str]:
    import httpx

    config = httpx.get(f"{served.http}/v2/models/tensorrt_llm/config", timeout=30).json()
    if "sampling_param_max_tokens" not in {i["name"] for i in config.get("input", [])}:  # an engine layout
        config = httpx.get(f"{served.http}/v2/models/ensemble/config", timeout=30).json()
    return {i["name"] for i in config.get("input", [])}


def measure(served: Served, levels: list[int], *, duration: float, repeats: int, max_tokens: int, stream: bool,
            tokenizer) -> dict[int, dict[str, dict]]:
    inputs = _inputs(served)
    _ready(served, inputs, max_tokens, stream)
    results: dict[int, dict[str, dict]] = {}
    for concurrency in levels:
        pooled = {side: {"tokens": 0, "requests": 0, "wall_s": 0.0, "ttft": [], "errors": []}
                  for side in ("generate", "openai")}
        order = []
        for r in range(repeats):  # a b, b a, a b …
            order += ["generate", "openai"] if r % 2 == 0 else ["openai", "generate"]
        for side in order:
            load = os.getloadavg()[0]
            result = asyncio.run(cell(side, served, inputs, concurrency=concurrency, duration=duration,
                                      max_tokens=max_tokens, stream=stream))
            tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in result["texts"])
            into = pooled[side]
            into["tokens"] += tokens
            into["requests"] += len(result["texts"])
            into["wall_s"] += result["wall_s"]
            into["ttft"] += result["ttft"]
            into["errors"] += result["errors"]
            into.setdefault("cells", []).append({"tokens_per_s": round(tokens / result["wall_s"], 2),
                                                 "requests": len(result["texts"]), "wall_s": round(result["wall_s"], 2),
                                                 "load_avg_1m": round(load, 2)})
            print(f"  {'stream' if stream else 'plain '} c={concurrency:<3} {side:<8} {tokens / result['wall_s']:7.1f} "
                  f"tok/s, {len(result['texts'])} requests, {len(result['errors'])} errors, load {load:.1f}",
                  flush=True)
        for side, into in pooled.items():
            into["tokens_per_s"] = round(into["tokens"] / into["wall_s"], 2) if into["wall_s"] else None
            into["ttft_p50_ms"] = round(float(np.percentile(into["ttft"], 50)) * 1000, 2) if into["ttft"] else None
            into["errors"] = {"count": len(into["errors"]), "first": into["errors"][0] if into["errors"] else None}
            del into["ttft"]
        results[concurrency] = pooled
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32", help="closed-loop levels (default 1,8,32)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per cell (default 15)")
    parser.add_argument("--repeats", type=int, default=2, help="cells per side and level, alternating (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per request (default 32)")
    parser.add_argument("--model", type=Path, default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the builds go (default: a temp dir)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="default: benchmarks/experiments/openai_front-<date>.json")
    args = parser.parse_args()
    levels = [int(v) for v in args.concurrency.split(",") if v.strip()]

    from transformers import AutoTokenizer

    if args.model is None:
        import smollm2

        args.model = smollm2.hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="forge-openai-front-"))
    started = time.time()
    repos = {"default": work / "smollm2", "not decoupled": work / "smollm2-not-decoupled"}
    for name, extra in (("default", ()), ("not decoupled", ("-o", "decoupled=false"))):
        if not (repos[name] / "forge-manifest.json").is_file():
            build(args.model, repos[name], *extra)
    results = {}
    for name, passes in (("default", (("plain", False), ("stream", True))), ("not decoupled", (("nd", False),))):
        served = Served(repos[name], work / f"serve-{name.replace(' ', '-')}.log")
        try:
            print(f"{name}: generate {served.http}, openai {served.openai}", flush=True)
            for key, stream in passes:
                results[key] = measure(served, levels, duration=args.duration, repeats=args.repeats,
                                       max_tokens=args.max_tokens, stream=stream, tokenizer=tokenizer)
        finally:
            served.stop()

    rows = []
    for c in levels:
        plain, stream, nd = results["plain"][c], results["stream"][c], results["nd"][c]
        gen, oai = plain["generate"]["tokens_per_s"], plain["openai"]["tokens_per_s"]
        t_gen, t_oai = stream["generate"]["ttft_p50_ms"], stream["openai"]["ttft_p50_ms"]
        streamed = stream["openai"]["tokens_per_s"]
        rows.append({"concurrency": c, "generate_tok_s": gen, "openai_tok_s": oai,
                     "ratio": round(oai / gen, 3) if gen and oai else None,
                     "generate_ttft_p50_ms": t_gen, "openai_ttft_p50_ms": t_oai,
                     "ttft_diff_ms": round(t_oai - t_gen, 2) if t_gen is not None and t_oai is not None else None,
                     "streamed_tok_s": {"generate": stream["generate"]["tokens_per_s"], "openai": streamed},
                     "streamed_ratio": round(streamed / oai, 3) if streamed and oai else None,
                     "not_decoupled_tok_s": {"generate": nd["generate"]["tokens_per_s"],
                                             "openai": nd["openai"]["tokens_per_s"]},
                     "errors": sum(r[s]["errors"]["count"] for r in (plain, stream, nd) for s in r)})
    head = f"{'c':>3}  {'generate tok/s':>14}  {'openai tok/s':>12}  {'ratio':>6}  {'TTFT gen p50':>12}  " \
           f"{'TTFT oai p50':>12}  {'diff ms':>8}  errors"
    print(head + "  streamed/plain  not-decoupled openai tok/s")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for row in rows:
        print(f"{row['concurrency']:>3}  {fmt(row['generate_tok_s'], '14.1f')}  {fmt(row['openai_tok_s'], '12.1f')}  "
              f"{fmt(row['ratio'], '6.3f')}  {fmt(row['generate_ttft_p50_ms'], '12.1f')}  "
              f"{fmt(row['openai_ttft_p50_ms'], '12.1f')}  {fmt(row['ttft_diff_ms'], '8.1f')}  {row['errors']:>6}  "
              f"{fmt(row['streamed_ratio'], '14.3f')}  {fmt(row['not_decoupled_tok_s']['openai'], '10.1f')}")
    goal = all(r["ratio"] is not None and r["ratio"] >= 0.95 and r["ttft_diff_ms"] is not None
               and r["ttft_diff_ms"] <= 2.0 for r in rows)
    print(f"goal (openai ≥ 0.95× generate tok/s, ≤ +2 ms p50 TTFT at every level): {'met' if goal else 'missed'}")
    machine = (f"{gen_docs.cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}, "
               f"Python {platform.python_version()}")
    gen_docs.write_results(
        "openai_front", out=args.json_out, machine_line=machine,
        command=" ".join(["python benchmarks/openai_front.py", *sys.argv[1:]]), **results_table(rows, goal),
        runtime_s=round(time.time() - started, 1),
        config={"model": str(args.model), "builds": {k: str(v) for k, v in repos.items()}, "levels": levels,
                "duration_s": args.duration, "repeats": args.repeats, "max_tokens": args.max_tokens,
                "prompts": PROMPTS, "greedy": True, "order": "alternating a,b / b,a per level"},
        measured=rows, goal_met=goal, cells=results)
    return 0


def results_table(rows: list[dict], goal: bool) -> dict:
    """The rows as the docs' table: the OpenAI front against the generate endpoint at each level."""
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    return {"title": "The OpenAI API front",
            "description": "Triton's generate endpoint against the OpenAI front's /v1/completions on one "
                           "`forge serve` of SmolLM2-135M-Instruct's default build (greedy, the same prompts and "
                           "max_tokens): generated tokens/s not streamed, time to first token and tokens/s "
                           "streamed; and the OpenAI front's tokens/s on the same build with `-o decoupled=false`; "
                           "closed loop, cells alternating between the two sides.",
            "columns": ["concurrency", "generate tok/s", "OpenAI tok/s", "ratio", "TTFT p50 generate ms",
                        "TTFT p50 OpenAI ms", "TTFT difference ms", "OpenAI streamed tok/s", "streamed / not",
                        "OpenAI tok/s, not decoupled", "errors"],
            "rows": [[r["concurrency"], fmt(r["generate_tok_s"], ".1f"), fmt(r["openai_tok_s"], ".1f"),
                      fmt(r["ratio"], ".3f"), fmt(r["generate_ttft_p50_ms"], ".1f"),
                      fmt(r["openai_ttft_p50_ms"], ".1f"), fmt(r["ttft_diff_ms"], ".1f"),
                      fmt(r["streamed_tok_s"]["openai"], ".1f"), fmt(r["streamed_ratio"], ".3f"),
                      fmt(r["not_decoupled_tok_s"]["openai"], ".1f"), r["errors"]] for r in rows],
            "notes": "Goal (OpenAI ≥ 0.95× generate tokens/s and ≤ +2 ms p50 TTFT at every level): "
                     f"{'met' if goal else 'missed'}."}


if __name__ == "__main__":
    sys.exit(main())
