"""forge infer: ask a served decoder (HTTP generate endpoint, or gRPC streaming with --stream)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UsageError

HELP = "send a prompt to a served model (HTTP generate endpoint; gRPC streaming with --stream)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=20, help="tokens to generate (default 20)")
    p.add_argument("--model", default=None, help="model to ask (default: the ensemble, else the one model that "
                   "takes text, such as an LLM-API repository's tensorrt_llm)")
    p.add_argument("--url", default="localhost:8000", help="HTTP endpoint host:port (default localhost:8000)")
    p.add_argument("--grpc-url", default=None,
                   help="gRPC endpoint for --stream / --stop-after-ms (default: --url's host, port 8001)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive (gRPC streaming; "
                   "needs a repository built with --decoupled)")
    p.add_argument("--stop-after-ms", type=float, default=None, metavar="MS",
                   help="cancel the request after this long (generation stops on the server)")
    p.add_argument("--exclude-input", action="store_true",
                   help="ask for the generated text only (the model's exclude_input_in_output or "
                        "sampling_param_exclude_input_from_output input); default: what the model returns")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="random seed (sampling)")
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--min-length", type=int, default=None)
    p.add_argument("--stop-words", action="append", default=[], metavar="WORD",
                   help="stop when this text is generated (repeatable)")
    p.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                   help="never generate this text (repeatable)")
    p.add_argument("--chat-template", type=Path, default=None, metavar="TOKENIZER_DIR",
                   help="wrap the prompt as a user message with this tokenizer's chat template")
    p.add_argument("--lora", default=None, metavar="NAME",
                   help="answer with this LoRA adapter of --repo (or a task id the server holds); sent over gRPC, "
                        "weights only when the server does not hold the adapter yet")
    p.add_argument("--repo", type=Path, default=None, metavar="DIR",
                   help="the served repository whose manifest names the --lora adapters")
    p.add_argument("--image", type=Path, default=None, metavar="FILE",
                   help="an image (PNG, JPEG, …) for a multimodal ensemble; the prompt holds its placeholder, "
                        "e.g. \"USER: <image>\\nWhat is shown? ASSISTANT:\"")
    p.add_argument("--json", action="store_true", help="print the whole response as json")


def _grpc_url(args: argparse.Namespace) -> str:
    if args.grpc_url:
        return args.grpc_url
    from ..clients.inference import grpc_target

    host = grpc_target(args.url).rsplit(":", 1)[0]  # host:port → host (a bare host stays as it is)
    return f"{host}:8001"


def chat_prompt(tokenizer_dir: Path, text: str) -> str:
    """``text`` as a single user turn in the tokenizer's chat template, ready for the assistant."""
    from transformers import AutoTokenizer

    if not tokenizer_dir.is_dir():
        raise UsageError(f"--chat-template {tokenizer_dir} is not a directory")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the tokenizer in {tokenizer_dir} has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def read_image(path: Path | None) -> bytes | None:
    """The bytes of ``--image FILE`` (the server decodes them; a bad image is its error to report)."""
    if path is None:
        return None
    if not path.is_file():
        raise UsageError(f"--image {path} is not a file")
    data = path.read_bytes()
    if not data:
        raise UsageError(f"--image {path} is empty")
    return data


def run(args: argparse.Namespace) -> int:
    from ..clients import inference, triton_http
    from ..ui import emit_json

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    if not args.prompt:
        raise UsageError("the prompt is empty")
    prompt = chat_prompt(args.chat_template, args.prompt) if args.chat_template else args.prompt
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
                "frequency_penalty": args.frequency_penalty, "min_length": args.min_length}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if args.exclude_input:
        sampling["exclude_input"] = True
    image = read_image(args.image)

    adapter = None
    if args.lora is not None:
        from ..clients import lora_requests

        (adapter,) = lora_requests.resolve([args.lora], args.repo)
    elif args.repo is not None:
        raise UsageError("--repo only names the adapters of --lora; give --lora NAME too")

    if args.model is None:
        args.model = triton_http.text_model(args.url)
    if not args.stream and args.stop_after_ms is None and adapter is None:
        inputs = inference.ModelInputs.from_config(triton_http.model_config(args.url, args.model))
        payload = inference.generate_payload(inputs, prompt, args.max_tokens, stop_words=args.stop_words,
                                          bad_words=args.bad_words, image=image, **sampling)
        response = triton_http.generate(args.url, args.model, payload)
        if args.json:
            emit_json(response)
        else:
            print(inference.text_of(response.get("text_output", "")))
        return 0

    stop_s = None if args.stop_after_ms is None else args.stop_after_ms / 1000.0
    with inference.GrpcSession(_grpc_url(args)) as session:
        inputs = session.config(args.model)
        tensors = inference.text_request(inputs, prompt, args.max_tokens, stream=args.stream,
                                      stop_words=args.stop_words, bad_words=args.bad_words, image=image, **sampling)
        pieces: list[str] = []

        def ask(extra) -> None:
            for event in session.stream(args.model, {**tensors, **extra}, stop_after_s=stop_s):
                if "text_output" in event.outputs:
                    piece = inference.text_of(event.outputs["text_output"])
                    pieces.append(piece)
                    if not args.json:
                        print(piece, end="" if args.stream else "\n", flush=True)

        try:
            if adapter is None:
                ask({})
            else:
                from ..clients.lora_requests import LoraRequests

                LoraRequests(inputs, weights_first=False).call(adapter, ask)
        except TimeoutError as exc:
            if not args.json:
                print(("\n" if args.stream and pieces else "") + f"({exc})", file=sys.stderr)
            else:
                emit_json({"text_output": "".join(pieces), "cancelled": True})
            return 0
        if args.json:
            emit_json({"text_output": "".join(pieces), "cancelled": False})
        elif args.stream:
            print()
    return 0
