"""Recovery: one model of a repository killed while another serves; how long until it answers again.

Two default builds (``--target python``) of one decoder, ``a_`` and ``b_``, in one repository served by
``forge serve --no-openai``. Clients of ``b_`` (Triton ``generate_stream``, back to back) run throughout; every
error they see is counted. Faults on ``a_``, in turn:

1. ``kill -9`` of ``a_tensorrt_llm``'s process, no request on it: forge serve loads the model again alone;
2. ``kill -9`` of its engine process (builds with ``-o engine_process=true``, the GPU default): the same;
3. ``kill -9`` of its process while clients stream from it through Triton itself: tritonserver never answers
   those, so forge serve restarts tritonserver (and ``b_``'s clients see it).

Per fault: what forge serve did, seconds from the kill until ``a_`` answered again, ``b_``'s requests and errors
meanwhile, GPU memory in use before and after (``nvidia-smi``).

    python benchmarks/recovery.py --model SMOLLM2_DIR
    python benchmarks/recovery.py --shape smollm2 --tokenizer SMOLLM2_DIR ...   # a GPU: random weights
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gen_docs  # noqa: E402 - the results file shape the docs read
from soak_servers import Serve, engine_of, gpu_used_mib  # noqa: E402

BACK_S = 300.0  # a model not answering by then is reported so
PROBE_S = 10.0  # a probe sent before forge serve noticed the death may never be answered (seen on a GPU)


def _forge(*argv: str) -> None:
    from forge.cli import main

    if main(list(argv)) != 0:
        sys.exit(f"benchmark: forge {' '.join(argv)} failed")


def build(model: Path, root: Path, extra: list[str]) -> Path:
    from forge.testing import merge_repositories

    for prefix in ("a_", "b_"):
        _forge("build", "--family", "llama", "--target", "python", "--model", str(model), "--name-prefix", prefix,
               "--out", str(root / prefix), *extra)
    repo = merge_repositories([root / "a_", root / "b_"], root / "repo")
    shutil.copy(root / "a_" / "forge-manifest.json", repo / "forge-manifest.json")
    return repo


def stream(http: str, model: str, tokens: int, timeout: float = 120.0) -> str | None:
    """One generate_stream to its end: None, or the error."""
    body = json.dumps({"text_input": "The capital of France is", "sampling_param_max_tokens": tokens,
                       "streaming": True}).encode()
    request = urllib.request.Request(f"{http}/v2/models/{model}/generate_stream", data=body)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200]!r}"
    except Exception as exc:  # noqa: BLE001 - a closed connection is an answer here
        return f"{type(exc).__name__}: {exc}"
    return text[text.index('"error"'):][:200] if '"error"' in text else None


class Clients:
    """``n`` clients of ``model`` streaming back to back until stopped."""

    def __init__(self, http: str, model: str, n: int, tokens: int):
        self.http, self.model, self.tokens = http, model, tokens
        self.halt = threading.Event()
        self.sent = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.halt.is_set():
            self.sent += 1
            error = stream(self.http, self.model, self.tokens)
            if error is not None:
                self.errors.append(error)
                time.sleep(0.2)

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(150)


def fault(serve: Serve, name: str, kill, *, load_a: int, clients: int, tokens: int) -> dict:
    http = serve.info["http"]
    said = len(serve.log.read_text().splitlines())
    before = gpu_used_mib()
    others = Clients(http, "b_tensorrt_llm", clients, tokens)
    on_a = Clients(http, "a_tensorrt_llm", load_a, 512) if load_a else None
    time.sleep(3.0)
    killed = time.monotonic()
    kill()
    if on_a is not None:
        on_a.stop()
    back, probes = None, []  # (seconds after the kill it was sent, how long it took, its error) of failed probes
    while time.monotonic() - killed < BACK_S:
        sent = time.monotonic()
        error = stream(http, "a_tensorrt_llm", 4, timeout=PROBE_S)
        if error is None:
            back = time.monotonic() - killed
            break
        probes.append((round(sent - killed, 1), round(time.monotonic() - sent, 1), error[:160]))
        time.sleep(0.1)
    time.sleep(2.0)
    others.stop()
    lines = serve.log.read_text().splitlines()[said:]
    did = ("restarted tritonserver" if any("restarting tritonserver" in line for line in lines) else
           "reloaded the model alone" if any("again alone" in line for line in lines) else "nothing")
    row = {"fault": name, "forge serve": did, "answering again after s": None if back is None else round(back, 1),
           "other model requests": others.sent, "other model errors": len(others.errors),
           "stranded requests on it": on_a.sent if on_a else 0,
           "gpu MiB before": before, "gpu MiB after": gpu_used_mib(),
           "other model error kinds": sorted({e[:160] for e in others.errors})[:5],
           "failed probes": len(probes), "slowest failed probe s": max((p[1] for p in probes), default=0),
           "probes": probes[:3] + probes[-2:],
           "lines": [line for line in lines if line.startswith("forge:")]}
    print(json.dumps({k: v for k, v in row.items() if k != "lines"}), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="HF decoder directory (e.g. SmolLM2-135M-Instruct)")
    parser.add_argument("--shape", help="random weights of this gpu_shapes shape instead (with --tokenizer)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory for --shape")
    parser.add_argument("--clients", type=int, default=8, help="clients of the other model (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request of the other model")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--forge-args", default="", help="more forge build arguments for both models "
                                                         "(e.g. '-o engine_process=true')")
    gen_docs.add_results_arguments(parser, "recovery")
    args = parser.parse_args()
    load = os.getloadavg()
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="forge-recovery-"))
    if args.shape:
        from gpu_shapes import make_model

        model = make_model(args.shape, args.tokenizer, root / args.shape)
    elif args.model:
        model = args.model
    else:
        sys.exit("benchmark: pass --model DIR or --shape NAME --tokenizer DIR")
    repo = build(model, root, args.forge_args.split())
    serve = Serve(repo, root / "serve.log", ("--no-openai", "--log-file", str(root / "triton.log"))).start()
    rows = []
    try:
        def kill_stub() -> None:
            os.kill(serve.stubs()["a_tensorrt_llm"], signal.SIGKILL)

        rows.append(fault(serve, "kill -9 of the model process, idle", kill_stub, load_a=0, clients=args.clients,
                          tokens=args.tokens))
        if engine_of(serve, "a_tensorrt_llm") is not None:
            rows.append(fault(serve, "kill -9 of its engine process", lambda: os.kill(
                engine_of(serve, "a_tensorrt_llm"), signal.SIGKILL), load_a=0, clients=args.clients,
                tokens=args.tokens))
        rows.append(fault(serve, "kill -9 of the model process, streamed to by Triton clients", kill_stub, load_a=4,
                          clients=args.clients, tokens=args.tokens))
    finally:
        status = serve.stop()
    left = serve.left()
    print(json.dumps({"forge serve exit status": status, "left": left}))
    write(args, rows, status, left, load)
    return 0


def write(args: argparse.Namespace, rows: list[dict], status: int, left: list[str], load) -> None:
    columns = ["fault", "forge serve", "answering again after s", "other model requests", "other model errors",
               "gpu MiB before", "gpu MiB after"]
    what = (f"random-weight {args.shape}-shape model (float16)" if args.shape else args.model.name)
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch: a CPU line
        device = None
    machine = gen_docs.machine(", ".join(x for x in (device, args.machine_note) if x), load)
    gen_docs.write_results(
        "recovery", out=args.json_out, machine_line=machine, title="One model killed while another serves",
        description=f"Two {'builds (`--target python ' + args.forge_args + '`)' if args.forge_args else 'default builds (`--target python`)'} of {what} in one repository under `forge serve "
                    f"--no-openai`; {args.clients} clients stream from the other model throughout.",
        columns=columns, rows=[[row[c] if row[c] is not None else "—" for c in columns] for row in rows],
        notes=f"forge serve exit status after SIGTERM: {status}; processes left: {len(left)}.", faults=rows)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped from outside (timeout): the server stops too
    sys.exit(main())
