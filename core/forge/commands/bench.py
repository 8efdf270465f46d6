"""forge bench: load a served decoder and report req/s, tokens/s and latency percentiles."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Iterator

from ..errors import UsageError

HELP = "benchmark a repository (started for the run) or a running server: req/s, tokens/s, p50/p99"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="REPO-or-URL",
                   help="a model repository (served for the run) or a running server's gRPC host:port")
    p.add_argument("--model", default=None,
                   help="model to load (default: tensorrt_llm for token-norm-dist, ensemble for prompts)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop: N requests in flight")
    mode.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--stream", action="store_true", help="stream tokens and report first-token latency")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a request is cancelled")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="count text models' output tokens with this tokenizer (default: words)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: the repository's vocabulary, else 1000)")
    p.add_argument("--json", action="store_true", help="print the summary as json")
    workloads = p.add_subparsers(dest="workload", metavar="WORKLOAD")
    dist = workloads.add_parser("token-norm-dist", help="random token ids, normally distributed lengths")
    dist.add_argument("--num-requests", type=int, default=32)
    dist.add_argument("--input-mean", type=float, default=128)
    dist.add_argument("--input-stdev", type=float, default=0)
    dist.add_argument("--output-mean", type=float, default=20)
    dist.add_argument("--output-stdev", type=float, default=0)
    dist.add_argument("--seed", type=int, default=0)
    text = workloads.add_parser("prompts", help="the given prompts, in turn, to a text model")
    text.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    text.add_argument("--prompts-file", type=Path, default=None, help="one prompt per line")
    text.add_argument("--output-len", type=int, default=32)
    text.add_argument("--num-requests", type=int, default=32)
    for sub in (dist, text):  # also accepted after the workload name
        sub.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the summary as json")


def _repo_facts(repo: Path, model: str) -> dict:
    """Vocabulary and input limit of a repository's tensorrt_llm model (python or C++ target)."""
    from .. import tritonconfig

    facts: dict = {}
    model_dir = repo / model
    for candidate in (model_dir / "1" / "hf" / "config.json", model_dir / "1" / "config.json"):
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text())
            except ValueError:
                continue
            vocab = data.get("vocab_size") or data.get("pretrained_config", {}).get("vocab_size")
            if vocab:
                facts["vocab"] = int(vocab)
            break
    if (model_dir / "config.pbtxt").is_file():
        value = tritonconfig.parameter(tritonconfig.read(model_dir), "max_input_len")
        if value and value.isdigit():
            facts["max_input"] = int(value)
    return facts


@contextlib.contextmanager
def _endpoint(target: str) -> Iterator[tuple[str, Path | None]]:
    path = Path(target)
    if not path.exists():
        if "/" in target and ":" not in target:
            raise UsageError(f"{target} does not exist (give a repository directory or a host:port)")
        yield target, None
        return
    from ..serving import launch
    from ..serving.server import TritonServer
    from .serve import _check

    _check(path)
    with TritonServer(path, world=launch.layout(path)) as server:
        yield server.grpc_url, path


def run(args: argparse.Namespace) -> int:
    from ..serving import bench
    from ..serving.client import GrpcSession
    from ..ui import emit_json

    workload = args.workload or "token-norm-dist"
    if workload == "token-norm-dist" and args.workload is None:
        args.num_requests, args.input_mean, args.input_stdev = 32, 128, 0
        args.output_mean, args.output_stdev, args.seed = 20, 0, 0
    model = args.model or ("tensorrt_llm" if workload == "token-norm-dist" else "ensemble")
    concurrency = args.concurrency if args.concurrency or args.request_rate else 1
    count = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731

    with _endpoint(args.target) as (url, repo):
        facts = _repo_facts(repo, model) if repo is not None else {}
        with GrpcSession(url) as session:
            inputs = session.config(model)
        for key, fact in (("vocab_size", "vocab"), ("max_input_len", "max_input")):
            value = inputs.parameters.get(key, "")
            if value.isdigit():  # forge's python target states them in its config
                facts.setdefault(fact, int(value))
        target = bench.Target(inputs, stream=args.stream, count_text=count)
        if workload == "token-norm-dist":
            items = bench.token_norm_dist(
                args.num_requests, input_mean=args.input_mean, input_stdev=args.input_stdev,
                output_mean=args.output_mean, output_stdev=args.output_stdev,
                vocab=args.vocab_size or facts.get("vocab", 1000), seed=args.seed,
                text=not target.token_mode, max_input=facts.get("max_input"))
        else:
            texts = list(args.prompt)
            if args.prompts_file:
                texts += [line.strip() for line in args.prompts_file.read_text().splitlines() if line.strip()]
            items = bench.prompts(texts, args.num_requests, args.output_len)
        if args.warmup > 0:
            bench.run(url, target, items[: args.warmup], concurrency=1, timeout_s=args.timeout)
        samples, wall = bench.run(url, target, items, concurrency=concurrency if args.request_rate is None else None,
                                  request_rate=args.request_rate, timeout_s=args.timeout)
    summary = bench.summarize(samples, wall)
    mode = f"rate {args.request_rate:g}/s" if args.request_rate else f"concurrency {concurrency}"
    summary.update({"model": model, "workload": workload, "mode": mode, "stream": args.stream})
    if args.json:
        emit_json(summary)
    else:
        print(bench.format_table([summary], label="mode"))
        print(f"{summary['succeeded']}/{summary['requests']} requests in {summary['wall_s']:.2f}s, "
              f"{summary['output_tokens']} output tokens ({model}, {workload})")
        if summary["first_error"]:
            print(f"first error: {summary['first_error']}")
    return 0 if summary["errors"] == 0 else 1
