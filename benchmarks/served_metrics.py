"""What a served cell cost, read from the server: its processes' CPU (/proc), Triton's per-model durations and
the python target's engine and sender counters (the metrics endpoint). serve_gpu.py's ``load`` records them.
"""

from __future__ import annotations

import os
from pathlib import Path

def process_cpu(server) -> dict[tuple, float]:
    """CPU seconds used so far by each thread of the server's session (Linux /proc), keyed (role, thread id,
    thread name); roles: ``tritonserver``, each python model's stub (its model name), ``<model> engine`` (an engine
    process, by its stub's model), ``other``."""
    from forge.server.processes import engine_processes, session_processes
    from forge.server.supervisor import stub_processes

    if server.process is None:
        return {}
    pids = session_processes(server.process.pid)
    ticks, stubs, engines = os.sysconf("SC_CLK_TCK"), stub_processes(server), engine_processes(pids)
    used: dict[tuple, float] = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        if pid == server.process.pid:
            role = "tritonserver"
        elif pid in stubs:
            role = stubs[pid]
        elif pid in engines:
            role = f"{stubs.get(engines[pid], '?')} engine"
        else:
            role = "other"
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp session … utime(11) stime(12)
            name = stat[stat.index("(") + 1:stat.rfind(")")]
            used[(role, int(task.name), name)] = (int(fields[11]) + int(fields[12])) / ticks
    return used


def cores_busy(before: dict[tuple, float], after: dict[tuple, float], wall_s: float) -> dict[str, dict]:
    """Each role's CPU time between two ``process_cpu`` snapshots per second of the cell (1.0: one core kept busy
    the whole time; the Python threads of one process share one GIL) and its busiest thread's (name and cores):
    a thread near 1.0 is what the role waits on."""
    if wall_s <= 0:
        return {}
    roles: dict[str, dict] = {}
    for key, seconds in after.items():
        busy = (seconds - before.get(key, 0.0)) / wall_s
        role = roles.setdefault(key[0], {"cores": 0.0, "busiest_thread": None, "busiest_cores": 0.0})
        role["cores"] += busy
        if busy > role["busiest_cores"]:
            role["busiest_thread"], role["busiest_cores"] = key[2], busy
    return {role: {k: round(v, 2) if isinstance(v, float) else v for k, v in entry.items()}
            for role, entry in sorted(roles.items(), key=lambda kv: -kv[1]["cores"]) if entry["cores"] >= 0.005}


#: Triton's per-model counters (microseconds summed over requests) that split a request's time
DURATIONS = ("request_duration", "queue_duration", "compute_input_duration", "compute_infer_duration",
             "compute_output_duration")


def model_durations(server) -> dict[str, dict[str, float]]:
    """Each model's Triton counters: successful requests and the summed durations of DURATIONS (µs)."""
    import re
    import urllib.request

    url = server.metrics_url if "://" in server.metrics_url else f"http://{server.metrics_url}"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, dict[str, float]] = {}
    for name, labels, value in re.findall(r'^nv_inference_(\w+?)(?:_us)?\{([^}]*)\} (\S+)$', text, re.M):
        model = re.search(r'model="([^"]+)"', labels)
        if model and (name in DURATIONS or name == "request_success"):
            entry = found.setdefault(model.group(1), {})
            entry[name] = entry.get(name, 0.0) + float(value)
    return found


def per_request_ms(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Mean ms per successful request of each model that served requests between two snapshots: the time
    Triton counted in its queue, in the model (compute_infer: for a model answering through its response
    sender, until ``execute`` returned) and in all (request)."""
    out = {}
    for model, now in after.items():
        then = before.get(model, {})
        done = now.get("request_success", 0) - then.get("request_success", 0)
        if done > 0:
            out[model] = {"requests": int(done), **{key.replace("_duration", ""): round(
                (now.get(key, 0) - then.get(key, 0)) / done / 1000, 3) for key in DURATIONS}}
    return out


def engine_counters(server, model: str | None) -> dict[str, float]:
    """The served engine's own counters (forge_decoder_engine_total) and its senders' (forge_decoder_responses_total,
    as ``sender_<kind>``) from the metrics endpoint."""
    import re
    import urllib.request

    if model is None:
        return {}
    with urllib.request.urlopen(f"http://{server.metrics_url}" if "://" not in server.metrics_url
                                else server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for family, prefix in (("forge_decoder_engine_total", ""), ("forge_decoder_responses_total", "sender_")):
        for kind, value in re.findall(r'%s\{[^}]*kind="(\w+)"[^}]*model="%s"[^}]*\} (\S+)'
                                      % (family, re.escape(model)), text) + re.findall(
                r'%s\{[^}]*model="%s"[^}]*kind="(\w+)"[^}]*\} (\S+)' % (family, re.escape(model)), text):
            found[prefix + kind] = float(value)
    return found


def engine_share(before: dict, after: dict, wall_s: float) -> dict:
    """What the engine thread did during a load cell: the share of the wall time inside its steps, its mean
    batch and ms per decoding step (the rest of the time it waited for requests)."""
    if not before or not after or not wall_s:
        return {}
    steps = after["decode_steps"] - before["decode_steps"]
    busy = after["step_seconds"] - before["step_seconds"]
    admitted = after.get("admitted", 0) - before.get("admitted", 0)
    extra = {}
    if admitted:
        extra = {"engine_queued_ms": round((after["queued_seconds"] - before["queued_seconds"]) / admitted * 1000, 3),
                 "engine_prefill_share": round((after["prefill_seconds"] - before["prefill_seconds"]) / busy, 3)
                 if busy else None}
        prefills = after.get("prefills", 0) - before.get("prefills", 0)
        if prefills:  # a server from before these counters has neither
            extra["engine_admitted_per_prefill"] = round(admitted / prefills, 2)
    if steps and "device_seconds" in after:  # CUDA graphs: the device's share of a step, and the wait for it
        for kind in ("device", "wait"):
            spent = after[f"{kind}_seconds"] - before.get(f"{kind}_seconds", 0.0)
            extra[f"engine_{kind}_ms_per_step"] = round(spent / steps * 1000, 3)
    responses = after.get("sender_responses", 0) - before.get("sender_responses", 0)
    if responses:  # the stub's sender threads: per response, and their threads kept busy (of sender_threads)
        for kind in ("build", "send"):
            spent = after[f"sender_{kind}_seconds"] - before.get(f"sender_{kind}_seconds", 0.0)
            extra[f"sender_{kind}_ms"] = round(spent / responses * 1000, 3)
            extra[f"sender_{kind}_threads"] = round(spent / wall_s, 2)
        extra["sender_responses_per_s"] = round(responses / wall_s, 1)
    return {**extra, "engine_busy": round(busy / wall_s, 3),
            "engine_mean_rows": round((after["decoded_rows"] - before["decoded_rows"]) / steps, 1) if steps else None,
            "engine_ms_per_step": round(busy / steps * 1000, 3) if steps else None}
