"""A one-node Slurm cluster in a directory: private munged, slurmctld and slurmd with a generated slurm.conf.

Real Slurm (the distribution's slurm-wlm and munge packages), nothing shared with a system
installation: its own munge socket and key, state and spool directories, free ports, one node named
after this directory's cluster. ``stop`` ends the three daemons it started (by their pids) and
cancels what is left of its jobs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from forge.server.processes import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> list[str]:
    """The programs this cluster needs that are not installed."""
    tools = [*DAEMONS, "sbatch", "squeue", "scancel", "srun", "scontrol"]
    return [t for t in tools if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, cpus: int | None = None):
        self.root = root
        # at least 4 CPUs declared (and believed: config_overrides), so a 2-rank job fits a 1-core machine
        self.cpus = cpus or max(4, os.cpu_count() or 1)
        self.node = "forgenode"
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))

    # -- set-up ---------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for sub in ("state", "spool", "munge", "log"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.socket = r / "munge" / "munge.socket"
        ctld_port, slurmd_port = free_ports(2)
        conf = {
            "ClusterName": "forgetest",
            "SlurmctldHost": f"{socket.gethostname().split('.')[0]}(127.0.0.1)",  # must name this host
            "MailProg": "/bin/true",
            "SlurmctldPort": ctld_port, "SlurmdPort": slurmd_port,
            "SlurmUser": "root", "SlurmdUser": "root",
            "AuthType": "auth/munge", "CredType": "cred/munge", "AuthInfo": f"socket={self.socket}",
            "StateSaveLocation": r / "state", "SlurmdSpoolDir": r / "spool",
            "SlurmctldPidFile": r / "slurmctld.pid", "SlurmdPidFile": r / "slurmd.pid",
            "SlurmctldLogFile": r / "log" / "slurmctld.log", "SlurmdLogFile": r / "log" / "slurmd.log",
            "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_Core",
            "SlurmdParameters": "config_overrides", "MpiDefault": "none", "ReturnToService": 2, "SchedulerType": "sched/backfill",
            "JobAcctGatherType": "jobacct_gather/none", "AccountingStorageType": "accounting_storage/none",
            "SlurmctldTimeout": 30, "SlurmdTimeout": 30, "KillWait": 5, "InactiveLimit": 0, "MinJobAge": 30,
        }
        lines = [f"{k}={v}" for k, v in conf.items()]
        lines += [f"NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} "
                  f"CPUs={self.cpus} State=UNKNOWN",
                  f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"]
        (r / "slurm.conf").write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                start_new_session=True)
        log.close()

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        self._write_config()
        r = self.root
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--socket={self.socket}",
                               f"--key-file={r / 'munge' / 'munge.key'}", f"--pid-file={r / 'munge' / 'munged.pid'}",
                               f"--log-file={r / 'log' / 'munged.log'}", f"--seed-file={r / 'munge' / 'seed'}"])
        self._wait(lambda: self.socket.exists(), "munged", 20)
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i"])
        self._spawn("slurmd", [_binary("slurmd"), "-D", "-N", self.node])
        self._wait(self._node_idle, "the node to be idle", timeout)
        return self

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
        return out.startswith("idle")

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log(name)}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}: {self.log('slurmctld')} {self.log('slurmd')}")

    def log(self, name: str) -> str:
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if path.exists() and path.read_text().strip():
                return path.read_text()[-2000:]
        return ""

    # -- use ------------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([_binary(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True,
                              check=check, timeout=60, cwd=cwd)

    def submit(self, script: Path, output: Path) -> str:
        out = self.run("sbatch", "--parsable", f"--output={output}", str(script), cwd=script.parent).stdout
        return out.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        out = self.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()
        return out or "GONE"

    def job_pids(self, job: str) -> list[int]:
        """Processes still running for ``job`` (slurmstepd and its tasks), from scontrol listpids."""
        out = self.run("scontrol", "listpids", job, check=False).stdout
        pids = []
        for line in out.splitlines()[1:]:
            first = line.split()[0] if line.split() else ""
            if first.isdigit():
                pids.append(int(first))
        return [p for p in pids if Path(f"/proc/{p}").exists()]

    def stop(self) -> None:
        self.run("scancel", "--full", "-u", "root", check=False) if self.processes.get("slurmctld") else None
        for name in reversed(DAEMONS):
            proc = self.processes.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
