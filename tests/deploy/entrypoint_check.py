"""Run a generated entrypoint's leader as its pod would, and ask what the pod's probes ask (run in a network
namespace of its own: the pod's fixed ports clash with nothing). Prints one JSON object of what it saw.

    python entrypoint_check.py ENTRYPOINT REPOSITORY MODEL_PROCESS
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

OPENAI = ("127.0.0.1", 9000)


def status(path: str) -> int | str:
    try:
        conn = http.client.HTTPConnection(*OPENAI, timeout=5)
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError as exc:
        return type(exc).__name__


def wait_for(path: str, wanted, limit: float, seen: list) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = status(path)
        if not seen or seen[-1] != got:
            seen.append(got)
        if got == wanted if not callable(wanted) else wanted(got):
            return True
        time.sleep(0.5)
    return False


def stub_pids(repo: str, model: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(args) > 1 and os.path.basename(args[0]) == "triton_python_backend_stub" and \
                args[1].startswith(f"{repo.rstrip('/')}/{model}/"):
            pids.append(int(pid))
    return pids


def main(script: str, repo: str, model: str) -> dict:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    env = {**os.environ, "FORGE_REPOSITORY": repo, "POD_IP": "127.0.0.1", "POD_NAME": "forge-0"}
    leader = subprocess.Popen(["bash", script, "leader"], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report: dict = {"ready_seen": [], "after_kill_seen": []}
    try:
        report["ready"] = wait_for("/health/ready", 200, 600, report["ready_seen"])
        report["live"] = status("/health")
        # liveness while a generation streams
        during: list = []

        def generate():
            conn = http.client.HTTPConnection(*OPENAI, timeout=120)
            body = json.dumps({"model": "tp1", "prompt": "What is machine learning?", "max_tokens": 30,
                               "stream": True, "ignore_eos": True})
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            for line in response:
                if line.startswith(b"data: ") and not during:
                    during.append(status("/health"))
                    during.append(status("/health/ready"))
            report["generation_status"] = response.status

        thread = threading.Thread(target=generate)
        thread.start()
        thread.join(150)
        report["during_generation"] = during
        stubs = stub_pids(repo, model)
        report["stubs"] = len(stubs)
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)
        report["not_ready_after_kill"] = wait_for("/health/ready", lambda s: s != 200, 60, report["after_kill_seen"])
        report["ready_again"] = wait_for("/health/ready", 200, 600, report["after_kill_seen"])
    finally:
        os.kill(leader.pid, signal.SIGTERM)
        try:
            report["exit"] = leader.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(leader.pid, signal.SIGKILL)
            report["exit"] = leader.wait()
    return report


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
