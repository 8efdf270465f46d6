"""forge bench: load served decoders and report req/s, generated tokens/s and latency percentiles.

One target (a repository, served for the run, or a running server) gives one summary, as
``benchmark_core_model.py`` does; ``--api openai --url …/v1`` loads any OpenAI-compatible server instead
(forge serve's front or another server), with the same workloads, loads and summary. ``--compare`` runs the same workload against several targets, one
server at a time, and prints them side by side with ratios to a baseline; ``--sweep`` repeats it over
concurrency levels or request rates and plots throughput against latency (PNG, one line per target).

Everything that can be checked before a server starts is checked first (targets, model, tokenizer,
workload file, prompt lengths against each repository's max input), and the only report file, the
plot, is written after the last run, so bad input never leaves a partial report.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..loadgen.targets import (DEFAULT_SWEEP, Source, Tokenizers, check_lengths, chat, endpoint, loads, measure,
    protocol_of, resolve, tokenizer_dirs, workload_items)

HELP = ("benchmark repositories (served for the run) or running servers: req/s, tokens/s, latency "
        "percentiles; --compare several side by side, --sweep loads into a plot")

WORKLOADS = ("token-norm-dist", "dataset", "prompts")  # = loadgen.runner.WORKLOADS (kept import-free here)
ENDPOINTS = ("chat", "completions")  # = loadgen.openai_load.ENDPOINTS
_SWEEP_VALUE = re.compile(r"^(?:(?:concurrency|rate|request-rate)[=:])?[0-9.]+(?:,[0-9.]+)*$")
_URL = re.compile(r"^(?:(?:grpc|http|https)://)?[A-Za-z0-9_.\-\[\]:]+:[0-9]+/?$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target_shown", nargs="?", metavar="REPO-or-URL",
                   help="a model repository (served for the run) or a running server's host:port "
                        "(gRPC, or HTTP with --protocol http); append #MODEL to pick its model")
    p.add_argument("--target", dest="target", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--compare", nargs="+", action="extend", default=[], metavar="REPO-or-URL",
                   help="run the same workload against each (one server at a time) and print them side by side")
    p.add_argument("--baseline", default=None, metavar="TARGET",
                   help="the target ratios are relative to (its label, as given, or its 1-based position; "
                        "default: the first)")
    p.add_argument("--model", default=None,
                   help="model to load (default: the ensemble, or the repository's only text model; "
                        "tensorrt_llm for token-norm-dist against a single target; with --api openai: the "
                        "server's only model id)")
    p.add_argument("--api", choices=("triton", "openai"), default="triton",
                   help="a Triton server or repository (default), or any OpenAI-compatible server at --url")
    p.add_argument("--url", default=None, metavar="URL",
                   help="--api openai: the server's base URL, ending /v1 (e.g. http://127.0.0.1:9000/v1)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default=None,
                   help="--api openai: /v1/chat/completions (default; the prompt as one user message) or "
                        "/v1/completions (the prompt as is)")
    p.add_argument("--api-key", default=None,
                   help="--api openai: sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", default=None, metavar="N[,N…]",
                      help="closed loop: N requests in flight (a list sweeps)")
    mode.add_argument("--request-rate", default=None, metavar="R[,R…]",
                      help="open loop: requests per second (a list sweeps)")
    p.add_argument("--arrivals", choices=("closed", "poisson", "constant"), default=None,
                   help="closed loop (with --concurrency), or Poisson / constant arrivals at --request-rate "
                        "(default: closed, or poisson with --request-rate)")
    p.add_argument("--sweep", nargs="?", const="", default=None, metavar="[concurrency=|rate=]V,V…",
                   help=f"measure at several loads and plot throughput vs latency (default levels: concurrency "
                        f"{','.join(map(str, DEFAULT_SWEEP))}, or the lists given to --concurrency/--request-rate)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="where to write the plot (default with --sweep: forge-bench-<time>.png here)")
    p.add_argument("--protocol", choices=("grpc", "http"), default=None,
                   help="gRPC streaming client, or HTTP generate / generate_stream (default: grpc, or what "
                        "the URLs' schemes say)")
    p.add_argument("--stream", action="store_true",
                   help="stream tokens: report time to first token and inter-token latency (decoupled models)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent to each target first (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a request is cancelled")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a served repository")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="count generated tokens with this tokenizer (default: each repository's own)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: the repository's vocabulary, else 1000)")
    p.add_argument("--lora", default=None, metavar="NAME[,NAME…]",
                   help="mix these LoRA adapters of the repository over the requests in turn ('base': none); "
                        "gRPC; weights go with each adapter's first request")
    p.add_argument("--lora-repo", type=Path, default=None, metavar="DIR",
                   help="the repository whose manifest names the --lora adapters (default: the target repository)")
    p.add_argument("--image", action="append", type=Path, default=[], metavar="FILE",
                   help="send images (repeatable; requests take them in turn) to a multimodal ensemble")
    p.add_argument("--image-placeholder", default="<image>",
                   help="put before prompts that lack it when --image is given (default <image>)")
    p.add_argument("--json", action="store_true", help="print the results as json")
    workloads = p.add_subparsers(dest="workload", metavar="WORKLOAD")
    dist = workloads.add_parser("token-norm-dist", help="normally distributed input/output lengths")
    dist.add_argument("--num-requests", type=int, default=32)
    dist.add_argument("--input-mean", type=float, default=128)
    dist.add_argument("--input-stdev", type=float, default=0)
    dist.add_argument("--output-mean", type=float, default=20)
    dist.add_argument("--output-stdev", type=float, default=0)
    dist.add_argument("--seed", type=int, default=0)
    data = workloads.add_parser("dataset", help="the seed's dataset file: a JSON list of "
                                "{input, instruction, output} (tensorrtllm_backend benchmark_core_model.py)")
    data.add_argument("--dataset", type=Path, required=True, help="the JSON file")
    data.add_argument("--tokenizer-dir", type=Path, default=None,
                      help="tokenizer (as in the seed; same as --tokenizer)")
    data.add_argument("--op-tokens-per-word", type=float, default=1.3,
                      help="output tokens per word of each entry's output (default 1.3)")
    data.add_argument("--num-requests", type=int, default=None, help="use the first N entries (default: all)")
    data.add_argument("--chat-template", action="store_true",
                      help="wrap each prompt as a user message in the tokenizer's chat template")
    data.add_argument("--skip-long", action="store_true",
                      help="leave out entries longer than a target's max input (the seed's behaviour) "
                           "instead of refusing them")
    text = workloads.add_parser("prompts", help="the given prompts, in turn")
    text.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    text.add_argument("--prompts-file", type=Path, default=None, help="one prompt per line")
    text.add_argument("--chat-template", action="store_true",
                      help="wrap each prompt as a user message in the tokenizer's chat template")
    text.add_argument("--output-len", type=int, default=32)
    text.add_argument("--num-requests", type=int, default=32)
    for sub in (dist, data, text):  # also accepted after the workload name
        sub.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the results as json")
    _separate_lists(p)


def _separate_lists(p: argparse.ArgumentParser) -> None:
    """Parse ``forge bench REPO [options] WORKLOAD …`` and ``--compare A B WORKLOAD …`` as meant.

    argparse alone would take a workload name as one more ``--compare`` target or as a bare
    ``--sweep``'s value, and an optional positional target followed by options as the workload. The
    arguments before the workload name are rewritten first: the target becomes ``--target=REPO``,
    each compared target ``--compare=X``, a bare ``--sweep`` ``--sweep=``.
    """
    parse = p.parse_known_args
    takes_value = {s for a in p._actions for s in a.option_strings if a.nargs is None}

    def parse_known_args(args=None, namespace=None):
        return parse(None if args is None else _rewrite(list(args), takes_value), namespace)

    p.parse_known_args = parse_known_args


def _rewrite(args: list[str], takes_value: set[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in WORKLOADS or arg == "--":
            return out + args[i:]
        if arg in takes_value and i + 1 < len(args):
            out += [arg, args[i + 1]]
            i += 2
            continue
        if not arg.startswith("-"):
            out.append(f"--target={arg}")
            i += 1
            continue
        if arg == "--compare":
            j = i + 1
            while j < len(args) and not args[j].startswith("-") and args[j] not in WORKLOADS:
                out.append(f"--compare={args[j]}")
                j += 1
            if j == i + 1:
                out.append(arg)
            i = j
            continue
        if arg == "--sweep":
            if i + 1 < len(args) and _SWEEP_VALUE.match(args[i + 1]):
                out.append(f"--sweep={args[i + 1]}")
                i += 2
            else:
                out.append("--sweep=")
                i += 1
            continue
        out.append(arg)
        i += 1
    return out


# -- loads -----------------------------------------------------------------------------------------

def _baseline(sources: list[Source], wanted: str | None) -> str:
    if wanted is None:
        return sources[0].label
    for source in sources:
        if wanted in (source.label, source.spec, source.where):
            return source.label
    if wanted.isdigit() and 1 <= int(wanted) <= len(sources):
        return sources[int(wanted) - 1].label
    raise UsageError(f"--baseline {wanted} is none of the targets ({', '.join(s.label for s in sources)})")


def run(args: argparse.Namespace) -> int:
    from ..loadgen import comparison, runner
    from ..ui import Progress, emit_json

    workload = args.workload or "token-norm-dist"
    if workload == "token-norm-dist" and args.workload is None:
        args.num_requests, args.input_mean, args.input_stdev = 32, 128, 0
        args.output_mean, args.output_stdev, args.seed = 20, 0, 0
    if args.api == "openai":
        return _run_openai(args, workload)
    for flag, value in (("--url", args.url), ("--endpoint", args.endpoint), ("--api-key", args.api_key)):
        if value is not None:
            raise UsageError(f"{flag} is for --api openai; a Triton target is a REPO-or-URL",
                             hint=f"add --api openai, or drop {flag}")
    if len(args.target) > 1:
        raise UsageError(f"one REPO-or-URL, not {len(args.target)}; to measure several use --compare "
                         f"{' '.join(args.target)}")
    specs = list(args.target) + list(args.compare)
    if not specs:
        raise UsageError("give a repository or a server's host:port (or --compare A B …)")
    compare = bool(args.compare)
    load_points = loads(args)
    sweeping = len(load_points) > 1 or args.sweep is not None
    legacy = not compare and not sweeping and args.plot is None  # one target, one load: today's summary
    if args.warmup < 0 or args.timeout <= 0:
        raise UsageError("--warmup must be 0 or more and --timeout positive")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise UsageError(f"--plot {args.plot} must name a .png file")
    protocol = protocol_of(args, specs)
    if args.lora and protocol != "grpc":
        raise UsageError("--lora sends LoRA tensors over gRPC; drop --protocol http")
    progress = None if legacy else Progress()

    from .infer import read_image

    images = [read_image(path) for path in args.image]
    # images go to the ensemble (text_input + image), never to the token-id tensorrt_llm model
    sources = resolve(specs, args, protocol, prefer_tokens=legacy and workload == "token-norm-dist" and not images)
    if images and any(source.token_mode for source in sources):
        raise UsageError("--image needs a multimodal ensemble (text_input + image), not a token-id model",
                         hint="point --model at the ensemble")
    baseline = _baseline(sources, args.baseline)
    explicit = args.tokenizer or getattr(args, "tokenizer_dir", None)
    dirs = tokenizer_dirs(sources, explicit, compare)
    loaded = Tokenizers()
    needed = not sources[0].token_mode or workload != "token-norm-dist"  # counting text, or encoding prompts
    tokenizers = {label: loaded.get(path) if path and needed else None for label, path in dirs.items()}
    if workload == "dataset" and sources[0].token_mode and tokenizers[sources[0].label] is None:
        raise UsageError("the dataset workload needs a tokenizer for token ids", hint="pass --tokenizer-dir DIR")
    streams = {}
    for source in sources:
        streams[source.label] = args.stream and source.streamable
        if args.stream and not source.streamable:
            if not compare:
                raise UsageError(f"--stream needs a decoupled model; {source.model!r} of {source.where} is not "
                                 "(rebuild with --decoupled)")
            source.notes.append(f"{source.label}: not decoupled, measured without streaming (no TTFT/ITL)")
    items = workload_items(args, workload, sources, tokenizers[sources[0].label])
    if getattr(args, "chat_template", False):
        chat(items, tokenizers[sources[0].label], dirs[sources[0].label])
    offered = len(items)
    items = check_lengths(items, sources, tokenizers, workload=workload,
                          skip_long=bool(getattr(args, "skip_long", False)))
    if len(items) < offered:
        sources[0].notes.append(f"{offered - len(items)} of {offered} {workload} requests are longer than a "
                                "target's max input and were left out (--skip-long)")
    if images:
        runner.attach_images(items, images)
    plot_path = args.plot
    if plot_path is None and sweeping:
        plot_path = Path(f"forge-bench-{time.strftime('%Y%m%d-%H%M%S')}.png")
    if plot_path is not None:
        plot_path = plot_path.absolute()

    rows: list[dict] = []
    for source in sources:
        with endpoint(source, protocol, args.startup_timeout, progress) as url:
            rows += measure(source, url, args=args, protocol=protocol, stream=streams[source.label], items=items,
                             load_points=load_points, tokenizer=tokenizers[source.label], progress=progress)
    failed = sum(row["errors"] for row in rows)

    if legacy:
        summary = {k: v for k, v in rows[0].items() if k not in ("target", "load", "concurrency", "request_rate",
                                                                 "arrivals")}
        summary.update({"model": sources[0].model, "workload": workload, "mode": load_points[0].legacy_mode,
                        "stream": args.stream, "protocol": protocol})
        if images:
            summary["images"] = [str(path) for path in args.image]
        if args.json:
            emit_json(summary)
        else:
            print(runner.format_table([summary], label="mode"))
            print(f"{summary['succeeded']}/{summary['requests']} requests in {summary['wall_s']:.2f}s, "
                  f"{summary['output_tokens']} output tokens ({sources[0].model}, {workload})")
            if summary["first_error"]:
                print(f"first error: {summary['first_error']}")
        return 0 if failed == 0 else 1

    comparison.add_ratios(rows, baseline)
    streaming = any(streams.values())
    title = (f"forge bench: {workload}, {len(items)} requests per load, {protocol}"
             f"{', streaming' if streaming else ''}; ratios vs {baseline}")
    if plot_path is not None:
        plot_path = comparison.plot(rows, plot_path, title=title, targets=[s.label for s in sources])
    notes = [note for source in sources for note in source.notes]
    if args.json:
        emit_json({
            "workload": _workload_facts(args, workload, len(items)), "protocol": protocol,
            "arrivals": load_points[0].arrivals, "stream": args.stream, "baseline": baseline,
            "targets": [{"label": s.label, "source": s.where, "kind": "repository" if s.repo is not None else "server",
                         "model": s.model, "inputs": "token ids" if s.token_mode else "text",
                         "max_input_len": s.max_input, "streamed": streams[s.label],
                         "tokenizer": str(dirs[s.label]) if dirs[s.label] else None}
                        for s in sources],
            "runs": rows, "notes": notes, "plot": str(plot_path) if plot_path else None})
    else:
        print(title)
        print(comparison.compare_table(rows, streaming=streaming))
        for note in notes:
            print(f"note: {note}")
        for row in rows:
            if row["first_error"]:
                print(f"first error ({row['target']}, {row['load']}): {row['first_error']}")
        if plot_path is not None:
            print(f"plot: {plot_path}")
    return 0 if failed == 0 else 1


def _run_openai(args: argparse.Namespace, workload: str) -> int:
    """``--api openai``: the same workloads, loads and summary against an OpenAI-compatible server."""
    from ..loadgen import comparison, openai_load, runner
    from ..ui import Progress, emit_json

    if args.target or args.compare:
        given = " ".join(args.target + args.compare)
        raise UsageError(f"--api openai loads the server at --url, not {given}",
                         hint="pass --url http://HOST:PORT/v1 (and --model ID) instead")
    for flag, value in (("--protocol", args.protocol), ("--lora", args.lora), ("--image", args.image),
                        ("--lora-repo", args.lora_repo), ("--vocab-size", args.vocab_size)):
        if value:
            raise UsageError(f"{flag} is for Triton targets; drop it with --api openai")
    if args.warmup < 0 or args.timeout <= 0:
        raise UsageError("--warmup must be 0 or more and --timeout positive")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise UsageError(f"--plot {args.plot} must name a .png file")
    openai_load.check_url(args.url)
    load_points = loads(args)
    sweeping = len(load_points) > 1 or args.sweep is not None
    endpoint_name = args.endpoint or "chat"
    templated = getattr(args, "chat_template", False)
    if templated and endpoint_name == "chat":
        raise UsageError("the chat endpoint applies the server's chat template; drop --chat-template",
                         hint="or template on this side with --endpoint completions --chat-template")
    where = args.tokenizer or getattr(args, "tokenizer_dir", None)
    tokenizer = Tokenizers().get(where) if where else None
    if workload == "token-norm-dist" and tokenizer is None:
        raise UsageError("token-norm-dist over --api openai needs --tokenizer DIR to write prompts of the drawn "
                         "token lengths", hint="pass the model's tokenizer directory, or use the prompts or "
                                               "dataset workload")
    target = openai_load.resolve(args.url, args.model, endpoint=args.endpoint, key=args.api_key, stream=args.stream)
    if tokenizer is not None:
        target.count_text = lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    items = workload_items(args, workload, [Source("", target.url, None, target.url, target.model)], tokenizer)
    if templated:
        chat(items, tokenizer, where)
    progress = Progress() if sweeping else None
    rows = openai_load.measure(target, items, load_points, warmup=args.warmup, timeout_s=args.timeout,
                               progress=progress)
    notes = openai_load.notes(target, rows)
    failed = sum(row["errors"] for row in rows)
    path = "/chat/completions" if target.endpoint == "chat" else "/completions"
    facts = {"api": "openai", "url": target.url, "endpoint": target.endpoint, "model": target.model,
             "stream": args.stream}
    if not sweeping and args.plot is None:
        summary = {k: v for k, v in rows[0].items() if k not in ("target", "load", "concurrency", "request_rate",
                                                                 "arrivals")}
        summary.update({**facts, "workload": workload, "mode": load_points[0].legacy_mode, "notes": notes})
        if args.json:
            emit_json(summary)
            return 0 if failed == 0 else 1
        print(runner.format_table([summary], label="mode"))
        counted = "uncounted" if summary["output_tokens"] is None else summary["output_tokens"]
        print(f"{summary['succeeded']}/{summary['requests']} requests in {summary['wall_s']:.2f}s, {counted} output "
              f"tokens ({target.model} at {target.url}{path}, {workload})")
    else:
        title = (f"forge bench: {workload}, {len(items)} requests per load, OpenAI {target.url}{path}"
                 f"{', streaming' if args.stream else ''}")
        plot_path = args.plot or Path(f"forge-bench-{time.strftime('%Y%m%d-%H%M%S')}.png")
        plot_path = comparison.plot(rows, plot_path.absolute(), title=title, targets=[target.label])
        if args.json:
            emit_json({**facts, "workload": _workload_facts(args, workload, len(items)),
                       "arrivals": load_points[0].arrivals, "runs": rows, "notes": notes, "plot": str(plot_path)})
            return 0 if failed == 0 else 1
        print(title)
        print(comparison.compare_table(rows, streaming=args.stream))
        print(f"plot: {plot_path}")
    for note in notes:
        print(f"note: {note}")
    for row in rows:
        if row["first_error"]:
            print(f"first error ({row['load']}): {row['first_error']}")
    return 0 if failed == 0 else 1


def _workload_facts(args: argparse.Namespace, workload: str, requests: int) -> dict[str, Any]:
    facts: dict[str, Any] = {"name": workload, "requests": requests}
    for key in ("input_mean", "input_stdev", "output_mean", "output_stdev", "seed", "output_len",
                "op_tokens_per_word"):
        if hasattr(args, key):
            facts[key] = getattr(args, key)
    if workload == "dataset":
        facts["dataset"] = str(args.dataset)
    if args.image:
        facts["images"] = [str(path) for path in args.image]
    return facts
