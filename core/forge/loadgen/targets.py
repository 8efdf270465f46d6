"""What ``forge bench`` measures against: targets (repositories or servers), load points, tokenizers, workloads.

Resolved and checked before any server starts (see :mod:`forge.commands.bench`); :func:`measure`
then serves one target at a time and runs the workload at one load point.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import ForgeError, UsageError

DEFAULT_SWEEP = (1, 2, 4, 8)
_URL = re.compile(r"^(?:(?:grpc|http|https)://)?[A-Za-z0-9_.\-\[\]:]+:[0-9]+/?$")


@dataclass(frozen=True)
class Load:
    """One load point: closed loop at ``concurrency`` or open loop at ``rate``."""

    concurrency: int | None = None
    rate: float | None = None
    arrivals: str = "closed"

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.rate is None else f"{self.rate:g}/s {self.arrivals}"

    @property
    def legacy_mode(self) -> str:
        return f"concurrency {self.concurrency}" if self.rate is None else f"rate {self.rate:g}/s"


def _numbers(text: str, flag: str, kind: Callable[[str], Any]) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes a number or a comma-separated list, not {text!r}") from None
    if not values:
        raise UsageError(f"{flag} needs a value")
    if any(v <= 0 for v in values):
        raise UsageError(f"{flag} values must be positive")
    return values


def loads(args: argparse.Namespace) -> list[Load]:
    """The load points the flags ask for (one without --sweep)."""
    concurrency = _numbers(args.concurrency, "--concurrency", int) if args.concurrency else None
    rates = _numbers(args.request_rate, "--request-rate", float) if args.request_rate else None
    if args.sweep:
        kind, _, values = args.sweep.rpartition("=") if "=" in args.sweep else args.sweep.rpartition(":")
        kind = kind or ("rate" if rates else "concurrency")
        if (concurrency and len(concurrency) > 1) or (rates and len(rates) > 1):
            raise UsageError("give the sweep's values once: to --sweep or to --concurrency/--request-rate")
        if kind == "concurrency":
            if rates:
                raise UsageError("--sweep sweeps concurrency levels here; drop --request-rate or use --sweep rate=…")
            concurrency, rates = _numbers(values, "--sweep", int), None
        else:
            if concurrency:
                raise UsageError("--sweep rate=… sweeps request rates; drop --concurrency")
            rates, concurrency = _numbers(values, "--sweep", float), None
    elif args.sweep is not None and not (concurrency and len(concurrency) > 1) and not (rates and len(rates) > 1):
        if rates:
            raise UsageError("--sweep over request rates needs several: --request-rate 1,2,4 or --sweep rate=1,2,4")
        concurrency = list(DEFAULT_SWEEP)
    arrivals = args.arrivals or ("poisson" if rates else "closed")
    if rates and arrivals == "closed":
        raise UsageError("--arrivals closed is a closed loop: give --concurrency, not --request-rate")
    if not rates and arrivals != "closed":
        raise UsageError(f"--arrivals {arrivals} needs --request-rate")
    if rates:
        return [Load(rate=r, arrivals=arrivals) for r in rates]
    return [Load(concurrency=c) for c in (concurrency or [1])]


# -- targets ---------------------------------------------------------------------------------------

@dataclass
class Source:
    """One thing compared: a repository to serve, or a running server, and the model asked there."""

    spec: str  # as given
    where: str  # path or URL, without #MODEL
    repo: Path | None
    url: str | None
    model: str = ""
    model_given: bool = False
    token_mode: bool = False
    max_input: int | None = None
    vocab: int | None = None
    tokenizer_dir: Path | None = None
    streamable: bool = False
    label: str = ""
    notes: list[str] = field(default_factory=list)


def _split(spec: str) -> tuple[str, str | None]:
    if "#" in spec and not Path(spec).exists():
        where, model = spec.rsplit("#", 1)
        return where, model or None
    return spec, None


def protocol_of(args: argparse.Namespace, specs: list[str]) -> str:
    schemes = {("http" if s.startswith(("http://", "https://")) else "grpc") for s in specs
               if s.startswith(("http://", "https://", "grpc://"))}
    if args.protocol:
        if schemes - {args.protocol}:
            raise UsageError(f"--protocol {args.protocol} disagrees with a URL's scheme "
                             f"({', '.join(sorted(schemes))}://)")
        return args.protocol
    if len(schemes) > 1:
        raise UsageError("the URLs mix http:// and grpc://; one protocol measures every target (pass --protocol)")
    return schemes.pop() if schemes else "grpc"


def _source(spec: str) -> Source:
    where, model = _split(spec)
    path = Path(where)
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{where} is not a model repository (not a directory)")
        return Source(spec, where, path, None, model or "", bool(model))
    if _URL.match(where):
        return Source(spec, where, None, where, model or "", bool(model))
    raise UsageError(f"{where} is neither a model repository directory nor a server's host:port")


def _repository_models(repo: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    from google.protobuf import json_format

    from ..clients.inference import ModelInputs
    from ..checks import load_configs

    configs, dirs, _ = load_configs(repo)
    return ({name: ModelInputs.from_config(json_format.MessageToDict(config, preserving_proto_field_name=True))
             for name, config in configs.items()}, dirs)


def _connect(url: str, protocol: str):
    """A session to a running server; an unreachable one is bad input (exit 2), said in one line."""
    from ..clients.inference import grpc_target
    from .runner import open_session

    client = open_session(url, protocol)
    if not client.live(timeout_s=5.0):
        client.close()
        shown = url if protocol == "http" else grpc_target(url)
        raise UsageError(f"cannot reach a Triton server's {'HTTP' if protocol == 'http' else 'gRPC'} endpoint at "
                         f"{shown}", hint="start one with 'forge serve REPO', check the host:port, or pass "
                         "--protocol http for an HTTP port")
    return client


def _server_models(url: str, protocol: str) -> dict[str, Any]:
    with contextlib.closing(_connect(url, protocol)) as client:
        models = {}
        for name in client.models():
            try:
                models[name] = client.config(name)
            except ForgeError:
                continue  # not loaded: nothing to ask there
        return models


def _text_capable(inputs) -> bool:
    from ..clients.inference import is_text_generator

    return is_text_generator(inputs)


def _token_capable(inputs) -> bool:
    return {"input_ids", "request_output_len"} <= set(inputs.inputs)


def _choose(source: Source, models: dict[str, Any], prefer_tokens: bool) -> None:
    """The model to ask, and whether it takes token ids; a repository without a text model is refused."""
    what = "repository" if source.repo is not None else "server"
    if source.model:
        inputs = models.get(source.model)
        if inputs is None:
            raise UsageError(f"{source.where} has no model {source.model!r} "
                             f"(it has: {', '.join(sorted(models)) or 'none'})")
        if not (_text_capable(inputs) or _token_capable(inputs)):
            raise UsageError(f"model {source.model!r} of {source.where} is not a text-generation model: it takes "
                             f"{', '.join(inputs.inputs) or 'no inputs'} "
                             "(a text model takes text_input and max_tokens)")
        source.token_mode = not _text_capable(inputs)
        return
    text = sorted(name for name, inputs in models.items() if _text_capable(inputs))
    if prefer_tokens and "tensorrt_llm" in models and _token_capable(models["tensorrt_llm"]):
        source.model, source.token_mode = "tensorrt_llm", True
    elif "ensemble" in text:
        source.model = "ensemble"
    elif len(text) == 1:
        source.model = text[0]
    elif text:
        raise UsageError(f"{source.where} serves several text models ({', '.join(text)}); pick one with "
                         f"--model or {source.where}#MODEL")
    else:
        outputs = sorted({o for inputs in models.values() for o in inputs.outputs})
        raise UsageError(f"{source.where} is not a text-generation {what}: no model takes text_input and max_tokens"
                         + (f" (its models return {', '.join(outputs[:4])})" if outputs else ""),
                         hint="compare decoder repositories (forge build --family gpt|llama …)")


def _has_tokenizer(path: Path) -> bool:
    from ..in_triton.forge_glue import TOKENIZER_CORE  # the files a tokenizer loads from

    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_CORE)


def _describe(source: Source, models: dict[str, Any], dirs: dict[str, Path]) -> None:
    """Max input, vocabulary, tokenizer and streaming of the chosen model, from configs and the manifest."""
    chosen = models[source.model]
    related = [chosen] + [models[s] for s in chosen.steps if s in models]
    pool = related if any("max_input_len" in m.parameters for m in related) else list(models.values())

    def ints(key: str) -> list[int]:
        return [int(m.parameters[key]) for m in pool if m.parameters.get(key, "").isdigit()]

    manifest = {}
    if source.repo is not None:
        from ..server import launch

        manifest = launch.manifest(source.repo)
    limits = (manifest.get("spec") or {}).get("limits") or {}
    max_inputs = ints("max_input_len") + ([int(limits["max_input_len"])] if limits.get("max_input_len") else [])
    source.max_input = min(max_inputs) if max_inputs else None
    vocab = ints("vocab_size") or _engine_vocab(source.model, chosen.steps, dirs)
    source.vocab = min(vocab) if vocab else None
    source.streamable = any(m.decoupled for m in related)
    candidates: list[Path] = []
    for inputs in related + list(models.values()):
        for key in ("tokenizer_dir", "model_dir", "hf_model_dir", "weights"):  # weights: hf-pipeline
            value = inputs.parameters.get(key)
            if not value or "${" in value:
                continue
            path = Path(value)
            if path.is_absolute():
                candidates.append(path)
            elif inputs.name in dirs:
                candidates += [dirs[inputs.name] / "1" / path, dirs[inputs.name] / path]
    if (manifest.get("spec") or {}).get("model"):
        candidates.append(Path(manifest["spec"]["model"]))
    found = next((c for c in candidates if _has_tokenizer(c)), None)
    source.tokenizer_dir = found.resolve() if found is not None else None


def _engine_vocab(model: str, steps: list[str], dirs: dict[str, Path]) -> list[int]:
    """The vocabulary a TensorRT-LLM engine or Hugging Face config next to the model states."""
    for name in [model, *steps]:
        if name not in dirs:
            continue
        for candidate in (dirs[name] / "1" / "config.json", dirs[name] / "1" / "hf" / "config.json"):
            try:
                data = json.loads(candidate.read_text())
            except (OSError, ValueError):
                continue
            vocab = data.get("vocab_size") or (data.get("pretrained_config") or {}).get("vocab_size")
            if vocab:
                return [int(vocab)]
    return []


def resolve(specs: list[str], args: argparse.Namespace, protocol: str, prefer_tokens: bool) -> list[Source]:
    """Every target checked before any server starts: what it is, its model, limits and tokenizer."""
    from ..server.launch import check_servable

    sources = [_source(spec) for spec in specs]
    for source in sources:
        if not source.model and args.model:
            source.model = args.model
        if source.repo is not None:
            check_servable(source.repo)
            models, dirs = _repository_models(source.repo)
        else:
            models, dirs = _server_models(source.url, protocol), {}
        _choose(source, models, prefer_tokens)
        _describe(source, models, dirs)
        if protocol == "http" and source.token_mode and models[source.model].decoupled:
            raise UsageError(f"model {source.model!r} of {source.where} is decoupled, and Triton's HTTP infer route "
                             "cannot serve decoupled models",
                             hint="use --protocol grpc, or the ensemble (--model ensemble)")
    if len({s.token_mode for s in sources}) > 1:
        raise UsageError("the targets' models take different inputs (token ids and text); compare like with like "
                         "with --model (e.g. --model ensemble)")
    labels = [_label(s) for s in sources]
    for source, label in zip(sources, labels):
        source.label = label if labels.count(label) == 1 else source.spec
    seen: dict[str, int] = {}
    for source in sources:
        seen[source.label] = seen.get(source.label, 0) + 1
        if seen[source.label] > 1:
            source.label = f"{source.label} ({seen[source.label]})"
    return sources


def _label(source: Source) -> str:
    name = source.repo.resolve().name if source.repo is not None else source.where
    return f"{name}#{source.model}" if source.model_given else name


# -- tokenizers and workload -----------------------------------------------------------------------

class Tokenizers:
    """Hugging Face tokenizers by directory, loaded once."""

    def __init__(self):
        self._loaded: dict[Path, Any] = {}

    def get(self, path: Path):
        path = Path(path)
        if path not in self._loaded:
            if not path.is_dir():
                raise UsageError(f"tokenizer {path} is not a directory")
            try:
                from transformers import AutoTokenizer

                self._loaded[path] = AutoTokenizer.from_pretrained(str(path))
            except (OSError, ValueError) as exc:
                raise UsageError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None
        return self._loaded[path]


def tokenizer_dirs(sources: list[Source], explicit: Path | None, compare: bool) -> dict[str, Path | None]:
    """Each target's tokenizer: --tokenizer, its repository's own, else the first one found among the others."""
    if explicit is not None:
        return {s.label: explicit for s in sources}
    found = next((s.tokenizer_dir for s in sources if s.tokenizer_dir is not None), None)
    result = {}
    for source in sources:
        tokenizer = source.tokenizer_dir or found
        if tokenizer is None and compare and not source.token_mode:
            raise UsageError(f"no tokenizer to count {source.label}'s generated tokens with",
                             hint="pass --tokenizer DIR (the model's Hugging Face directory)")
        if source.tokenizer_dir is None and tokenizer is not None and explicit is None:
            source.notes.append(f"{source.label}: tokens counted with {tokenizer}")
        result[source.label] = tokenizer
    return result


def workload_items(args: argparse.Namespace, workload: str, sources: list[Source], tokenizer) -> list:
    """The requests every target gets (the same list for all)."""
    from . import runner

    if workload == "token-norm-dist":
        max_inputs = [s.max_input for s in sources if s.max_input]
        vocabs = [s.vocab for s in sources if s.vocab]
        return runner.token_norm_dist(
            args.num_requests, input_mean=args.input_mean, input_stdev=args.input_stdev,
            output_mean=args.output_mean, output_stdev=args.output_stdev,
            vocab=args.vocab_size or (min(vocabs) if vocabs else 1000), seed=args.seed,
            text=not sources[0].token_mode, max_input=min(max_inputs) if max_inputs else None,
            tokenizer=tokenizer)
    if workload == "dataset":
        return runner.read_dataset(args.dataset, num_requests=args.num_requests,
                                  op_tokens_per_word=args.op_tokens_per_word)
    texts = list(args.prompt)
    if args.prompts_file:
        if not args.prompts_file.is_file():
            raise UsageError(f"--prompts-file {args.prompts_file} does not exist")
        texts += [line.strip() for line in args.prompts_file.read_text().splitlines() if line.strip()]
    return runner.prompts(texts, args.num_requests, args.output_len)


def chat(items: list, tokenizer, where: Path | None) -> None:
    """Each prompt as a single user turn in the tokenizer's chat template, ready for the answer."""
    if tokenizer is None:
        raise UsageError("--chat-template needs a tokenizer", hint="pass --tokenizer DIR")
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the tokenizer in {where} has no chat template; drop --chat-template")
    for item in items:
        item.text = tokenizer.apply_chat_template([{"role": "user", "content": item.text}], tokenize=False,
                                                  add_generation_prompt=True)


def check_lengths(items: list, sources: list[Source], tokenizers: dict[str, Any], *, workload: str,
                  skip_long: bool) -> list:
    """Refuse (or, with --skip-long, leave out) prompts longer than a target's max input."""
    kept = []
    for number, item in enumerate(items, 1):
        too_long = None
        for source in sources:
            if not source.max_input:
                continue
            tokenizer = tokenizers.get(source.label)
            if item.tokens is not None:
                length = len(item.tokens)
            elif tokenizer is not None:
                length = len(tokenizer.encode(item.text))
            else:
                continue
            if length > source.max_input:
                too_long = (source, length)
                break
        if too_long is None:
            kept.append(item)
            continue
        if skip_long:
            continue
        source, length = too_long
        hint = "shorten it, or rebuild with a larger --max-input-len"
        if workload == "dataset":
            hint += "; or pass --skip-long to leave such entries out, as the seed's benchmark does"
        raise UsageError(f"{workload} request {number} is {length} tokens, longer than {source.label}'s max input "
                         f"({source.max_input} tokens)", hint=hint)
    if not kept:
        raise UsageError(f"every {workload} request is longer than a target's max input")
    return kept


# -- running -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def endpoint(source: Source, protocol: str, startup_timeout: float, progress=None) -> Iterator[str]:
    """The URL to load: a running server's, or that of a tritonserver started on the repository for the run."""
    if source.repo is None:
        yield source.url
        return
    from ..server import launch
    from ..server.triton_server import TritonServer

    if progress:
        progress(f"{source.label}: starting tritonserver on {source.repo}")
    with TritonServer(source.repo, world=launch.layout(source.repo), startup_timeout=startup_timeout) as server:
        yield server.http_url if protocol == "http" else server.grpc_url


def lora_mix(source: Source, args: argparse.Namespace, protocol: str) -> list:
    """``--lora A,B,base``: the adapters the requests use in turn (None: the base model)."""
    if not getattr(args, "lora", None):
        if getattr(args, "lora_repo", None) is not None:
            raise UsageError("--lora-repo only names the adapters of --lora; give --lora NAME[,NAME…] too")
        return []
    from ..clients import lora_requests

    if protocol != "grpc":
        raise UsageError("--lora sends LoRA tensors over gRPC; drop --protocol http")
    names = [n.strip() for n in args.lora.split(",") if n.strip()]
    repo = args.lora_repo or source.repo
    resolved = iter(lora_requests.resolve([n for n in names if n != "base"], repo))
    return [None if n == "base" else next(resolved) for n in names]


def measure(source: Source, url: str, *, args: argparse.Namespace, protocol: str, stream: bool, items: list,
             load_points: list[Load], tokenizer, progress=None) -> list[dict]:
    from . import runner

    with contextlib.closing(runner.open_session(url, protocol)) as client:
        inputs = client.config(source.model)  # the served config is the authority
    count = encode = echoes = None
    if tokenizer is not None:
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        encode = lambda text: list(tokenizer.encode(text))  # noqa: E731
        echoes = lambda text: [tokenizer.decode(tokenizer.encode(text), skip_special_tokens=skip)  # noqa: E731
                               for skip in (True, False)]
    target = runner.Target(inputs, stream=stream, count_text=count, encode=encode, echoes=echoes)
    mix = lora_mix(source, args, protocol)
    if mix:
        target.use_lora(mix, items)
    target.placeholder = getattr(args, "image_placeholder", target.placeholder)
    if stream and protocol == "http" and target.token_mode:
        raise UsageError("--stream over HTTP needs a text model (generate_stream); use --protocol grpc for token ids")
    if args.warmup > 0:
        runner.run(url, target, items[: args.warmup], concurrency=1, timeout_s=args.timeout, protocol=protocol)
    rows = []
    for load in load_points:
        samples, wall = runner.run(url, target, items, concurrency=load.concurrency, request_rate=load.rate,
                                  arrivals=load.arrivals, timeout_s=args.timeout, protocol=protocol)
        row = {"target": source.label, "load": load.label, "concurrency": load.concurrency,
               "request_rate": load.rate, "arrivals": load.arrivals, **runner.summarize(samples, wall)}
        if mix:
            row["lora"] = [a.name if a else "base" for a in mix]
            row["lora_weights_resent"] = target.lora.retries
        rows.append(row)
        if progress:
            progress(f"{source.label}, {load.label}: {row['req_per_s']:.2f} req/s, {row['tokens_per_s']:.1f} tok/s, "
                     f"{row['errors']} errors")
    return rows
