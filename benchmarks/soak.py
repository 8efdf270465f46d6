"""Soak: mixed traffic against ``forge serve`` while model processes are killed, then SIGTERM (issue 33).

Loopback only, bounded (``--phase-seconds`` per phase). A tiny random GPT-2 (or ``--model`` an HF directory,
e.g. SmolLM2) is built with ``--target python --decoupled`` and served by ``forge serve`` with the OpenAI API.
Clients send, back to back: Triton ``generate_stream``, OpenAI chat (plain and streamed), streams the client
cancels after two events, and requests the client abandons after 0.2 s. Phases: a quiet baseline, then
``kill -9`` of each model process in turn, then SIGTERM (the drain). Per phase it prints requests sent,
succeeded, failed with a clear error, hung (no end within 60 s: must be 0), lost (a stream that ended with
neither its last event nor an error: must be 0), the time until ``/health/ready`` and a chat answer again,
and RSS / open file descriptors of forge serve and its processes before and after.

    python benchmarks/soak.py --phase-seconds 30 --out benchmarks/results/soak-$(date +%F).json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HUNG_S = 60.0
KINDS = ("triton_stream", "chat", "chat_stream", "cancelled", "abandoned")


def build(model: Path | None, out: Path) -> Path:
    """A decoupled python-target repository of ``model`` (default: a tiny random GPT-2 with a chat template)."""
    from forge.cli import main

    if model is None:
        sys.path.insert(0, str(ROOT / "tests" / "serve"))
        from serve_models import make_gpt2

        model = make_gpt2(out.parent / "gpt2-tiny")
        config = json.loads((model / "tokenizer_config.json").read_text())
        config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["build", "--family", "gpt" if "gpt2" in model.name else "llama", "--model", str(model), "--out",
            str(out), "--target", "python", "--decoupled", "--max-input-len", "64", "--max-seq-len", "128",
            "--max-batch-size", "8", "--dtype", "float32"]
    assert main(argv) == 0, f"forge {' '.join(argv)} failed"
    return out


class Tally:
    """Outcomes of the requests sent in one phase."""

    def __init__(self, name: str):
        self.name = name
        self.counts = {k: 0 for k in ("sent", "succeeded", "failed_clear", "hung", "lost", "abandoned")}
        self.errors: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if error:
                key = error[:120]
                self.errors[key] = self.errors.get(key, 0) + 1


class Traffic:
    """``n`` clients cycling through the request kinds; each outcome goes to the current phase's tally."""

    def __init__(self, info: dict, model: str, n: int = 4):
        self.http, self.base, self.model = info["http"], info["openai"].removesuffix("/v1"), model
        self.tally = Tally("start")
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        turn = index
        while not self.halt.is_set():
            kind = KINDS[turn % len(KINDS)]
            turn += 1
            tally = self.tally
            tally.add("sent")
            try:
                outcome, error = getattr(self, f"_{kind}")()
            except TimeoutError as exc:
                outcome, error = "hung", f"{kind}: {exc}"
            except (urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
                outcome, error = "failed_clear", f"{kind}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            tally.add(outcome, error)
            if outcome != "succeeded":
                time.sleep(0.2)

    def _post(self, url: str, body: dict, timeout: float = HUNG_S):
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            message = exc.read().decode(errors="replace")[:200]
            raise ValueError(f"HTTP {exc.code}: {message}") from None
        except socket.timeout as exc:
            raise TimeoutError(str(exc)) from None

    def _chat_body(self, stream: bool) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 60,
                "stream": stream}

    def _events(self, response, limit: int | None = None) -> list[str]:
        events = []
        try:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if limit and len(events) >= limit:
                        break
        except socket.timeout as exc:
            raise TimeoutError(str(exc)) from None
        return events

    def _triton_stream(self):
        with self._post(f"{self.http}/v2/models/ensemble/generate_stream",
                        {"text_input": "hello world", "max_tokens": 60, "stream": True}) as response:
            events = self._events(response)
        errors = [e for e in events if '"error"' in e]
        if errors:
            return "failed_clear", f"triton_stream: {errors[0][:120]}"
        return ("succeeded", None) if events else ("lost", "triton_stream: no event")

    def _chat(self):
        with self._post(f"{self.base}/v1/chat/completions", self._chat_body(False)) as response:
            body = json.loads(response.read())
        return ("succeeded", None) if body.get("choices") else ("lost", f"chat: {body}")

    def _chat_stream(self):
        with self._post(f"{self.base}/v1/chat/completions", self._chat_body(True)) as response:
            events = self._events(response)
        errors = [e for e in events if e.startswith('{"error"')]
        if errors:
            return "failed_clear", f"chat_stream: {errors[0][:120]}"
        return ("succeeded", None) if events and events[-1] == "[DONE]" else ("lost", f"chat_stream: {events[-2:]}")

    def _cancelled(self):
        with self._post(f"{self.base}/v1/chat/completions", self._chat_body(True)) as response:
            events = self._events(response, limit=2)  # then the connection closes: the server cancels
        return ("succeeded", None) if len(events) == 2 else ("lost", f"cancelled: {events}")

    def _abandoned(self):
        try:
            with self._post(f"{self.base}/v1/chat/completions", self._chat_body(False), timeout=0.2) as response:
                response.read()
        except (TimeoutError, urllib.error.URLError, socket.timeout):
            pass
        return "abandoned", None

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(HUNG_S + 5)


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def footprint(pid: int) -> dict:
    """RSS (MiB) and open file descriptors of ``pid`` and every process under it."""
    rss, fds, count = 0, 0, 0
    for p in descendants(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            rss += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
            fds += len(os.listdir(f"/proc/{p}/fd"))
            count += 1
        except (OSError, StopIteration):
            pass
    return {"rss_mib": round(rss / 1024), "fds": fds, "processes": count}


def stubs(pid: int) -> dict[str, int]:
    found = {}
    for p in descendants(pid):
        try:
            args = Path(f"/proc/{p}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if Path(args[0]).name == "triton_python_backend_stub":
            found[Path(args[1]).parent.parent.name] = p
    return found


def ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def chat_once(base: str, model: str) -> bool:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF directory (default: a tiny random GPT-2)")
    parser.add_argument("--phase-seconds", type=float, default=30.0, help="traffic per phase (default 30)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="forge-soak-"))
    repo = build(args.model, work / "repo")
    serve = subprocess.Popen([sys.executable, "-c", "from forge.cli import run; run()", "serve", str(repo),
                              "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0",
                              "--served-model-name", "soak", "--json"],
                             stdout=subprocess.PIPE, stderr=open(work / "serve.err", "w"), text=True,
                             start_new_session=True)
    text = ""
    for line in serve.stdout:
        text += line
        if line.rstrip() == "}":
            break
    info = json.loads(text)
    base = info["openai"].removesuffix("/v1")
    traffic = Traffic(info, "soak", args.clients)
    rows = []

    def phase(name: str, fault=None) -> None:
        tally = traffic.tally = Tally(name)
        before = footprint(serve.pid)
        started = time.monotonic()
        recover = None
        if fault is not None:
            fault()
            deadline = started + 300
            while ready(base) and time.monotonic() - started < 30:  # the supervisor notices within a second
                time.sleep(0.1)
            while not (ready(base) and chat_once(base, "soak")) and time.monotonic() < deadline:
                time.sleep(0.25)
            recover = round(time.monotonic() - started, 1)
        time.sleep(max(0.0, args.phase_seconds - (time.monotonic() - started)))
        after = footprint(serve.pid)
        # the tally's counts are read at the end: requests still in flight now are counted when they end
        rows.append({"phase": name, "tally": tally, "recover_s": recover, "before": before, "after": after})

    phase("baseline")
    for model in ("preprocessing", "tensorrt_llm", "postprocessing"):
        phase(f"kill -9 {model}", lambda m=model: os.kill(stubs(serve.pid)[m], signal.SIGKILL))
    # SIGTERM under load: the clients keep sending; requests in flight finish, new ones are refused
    tally = traffic.tally = Tally("SIGTERM (drain)")
    before = footprint(serve.pid)
    started = time.monotonic()
    serve.send_signal(signal.SIGTERM)
    status = serve.wait(120)
    drained = round(time.monotonic() - started, 1)
    traffic.stop()
    left = [p for p in descendants(serve.pid) if p != serve.pid]
    rows.append({"phase": "SIGTERM (drain)", "tally": tally, "recover_s": None, "drain_s": drained,
                 "exit_status": status, "before": before, "after": {"processes_left": len(left)}})
    for row in rows:
        tally = row.pop("tally")
        row.update(tally.counts, errors=tally.errors)
        print(json.dumps(row), flush=True)
    print((work / "serve.err").read_text(), file=sys.stderr)

    header = f"{'phase':<26}{'sent':>6}{'ok':>6}{'failed':>8}{'hung':>6}{'lost':>6}{'aband.':>8}{'recover s':>11}" \
             f"{'RSS MiB before→after':>23}{'fds before→after':>19}"
    print(header)
    for row in rows:
        after = row["after"]
        print(f"{row['phase']:<26}{row['sent']:>6}{row['succeeded']:>6}{row['failed_clear']:>8}{row['hung']:>6}"
              f"{row['lost']:>6}{row['abandoned']:>8}{str(row.get('recover_s') or row.get('drain_s', '')):>11}"
              f"{str(row['before']['rss_mib']) + '→' + str(after.get('rss_mib', '-')):>23}"
              f"{str(row['before']['fds']) + '→' + str(after.get('fds', '-')):>19}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
            "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                       "no GPU)", "date": datetime.date.today().isoformat(),
            "model": str(args.model or "tiny random GPT-2 (tests/serve/serve_models.py make_gpt2)"),
            "target": "python --decoupled", "clients": args.clients, "phase_seconds": args.phase_seconds,
            "phases": rows}, indent=2) + "\n")
    bad = sum(r["hung"] + r["lost"] for r in rows)
    return 0 if bad == 0 and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
