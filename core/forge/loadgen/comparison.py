"""Load runs side by side: one row per target and load, ratios to a baseline, a table and a throughput–latency plot.

The rows are :func:`forge.loadgen.runner.summarize` summaries with ``target`` and ``load`` added (``forge bench
--compare`` / ``--sweep``, and the OpenAI-compatible sweeps of :mod:`.openai_load`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

from .runner import ms_text, rate_text, table_text


def add_ratios(rows: list[dict[str, Any]], baseline: str) -> None:
    """Each row's req/s and tokens/s as a multiple of the baseline target's at the same load."""
    base = {row["load"]: row for row in rows if row["target"] == baseline}
    for row in rows:
        ref = base.get(row["load"])
        for key in ("req_per_s", "tokens_per_s"):
            row[f"{key}_ratio"] = (round(row[key] / ref[key], 3) if ref and ref[key] and row[key] is not None
                                   else None)


def compare_table(rows: list[dict[str, Any]], *, streaming: bool) -> str:
    """The comparison side by side: one row per target and load, ratios against the baseline."""
    head = ["target", "load", "req/s", "tok/s", "lat p50", "p90", "p99"]
    if streaming:
        head += ["TTFT p50", "p90", "p99", "ITL p50", "p90", "p99"]
    head += ["errors", "× req/s", "× tok/s"]
    lines = []
    for row in rows:
        line = [row["target"], row["load"], f"{row['req_per_s']:.2f}", rate_text(row["tokens_per_s"]),
                *_triple(row.get("latency_ms"))]
        if streaming:
            line += [*_triple(row.get("first_token_ms")), *_triple(row.get("inter_token_ms"))]
        line += [f"{row['errors']}/{row['requests']}" if row["errors"] else "0",
                 _ratio(row.get("req_per_s_ratio")), _ratio(row.get("tokens_per_s_ratio"))]
        lines.append(line)
    return table_text(head, lines)


def _triple(stats: dict[str, float] | None) -> list[str]:
    stats = stats or {}
    return [ms_text(stats.get("p50")), ms_text(stats.get("p90")), ms_text(stats.get("p99"))]


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def plot(rows: list[dict[str, Any]], path: Path, *, title: str, targets: Sequence[str]) -> Path:
    """PNG of throughput (generated tokens/s) against latency, one line per target, points labelled by load.

    With streaming a second panel shows time to first token. Written to a temporary file and renamed
    into place, so an interrupted run leaves no half-written plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    streaming = any(row.get("first_token_ms") for row in rows)
    panels = [("latency_ms", "request latency (ms)")] + ([("first_token_ms", "time to first token (ms)")]
                                                         if streaming else [])
    figure, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.8), squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], panels):
        for index, name in enumerate(targets):
            points = [r for r in rows if r["target"] == name and r.get(key) and r["tokens_per_s"] is not None]
            if not points:
                continue
            color = f"C{index % 10}"
            x = [r["tokens_per_s"] for r in points]
            ax.plot(x, [r[key]["p50"] for r in points], "o-", color=color, label=f"{name} p50")
            ax.plot(x, [r[key]["p99"] for r in points], "x--", color=color, alpha=0.5, label=f"{name} p99")
            for r in points:
                ax.annotate(r["load"], (r["tokens_per_s"], r[key]["p50"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
        ax.set_xlabel("throughput (generated tokens/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(handle)
    try:
        figure.savefig(scratch, format="png", dpi=120)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(scratch, 0o666 & ~umask)  # mkstemp's 0600 is for the scratch file, not the plot
        os.replace(scratch, path)
    finally:
        plt.close(figure)
        if os.path.exists(scratch):
            os.unlink(scratch)
    return path
