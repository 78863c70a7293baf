"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's slurm-wlm,
each with its own key, config, state, spool and socket folders, on loopback only, started and stopped
by the pids we started. Settings follow ../shared/FIELD-NOTES.md (no accounting storage: job states
after completion come from the jobcomp file)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from container_daemons import stop

PARTITION = "runner-test"


def missing() -> str | None:
    absent = [name for name in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (`make test` installs Debian's slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users and needs root"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Cluster:
    folder: Path
    conf: Path
    jobcomp: Path
    partition: str = PARTITION

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, runner) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}


@contextlib.contextmanager
def slurm_cluster(cpus: int | None = None) -> Iterator[Cluster]:
    cpus = cpus or os.cpu_count() or 2
    memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
    with tempfile.TemporaryDirectory(prefix="slurm-", dir="/tmp") as scratch:
        folder = Path(scratch)
        for sub in ("munge", "state", "spool", "log", "run"):
            (folder / sub).mkdir()
        (folder / "munge").chmod(0o755)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munge_socket = folder / "munge" / "munge.socket"
        ctld_port, d_port = _free_ports(2)
        conf = folder / "slurm.conf"
        jobcomp = folder / "log" / "jobcomp.txt"
        conf.write_text("\n".join([
            "ClusterName=runnertest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={jobcomp}",
            "MinJobAge=2",
            "KillWait=10",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        env = {**os.environ, "SLURM_CONF": str(conf)}
        processes = []
        try:
            processes.append(subprocess.Popen(
                ["munged", "-F", "--key-file", str(key), "--socket", str(munge_socket), "--pid-file",
                 str(folder / "munge" / "munged.pid"), "--seed-file", str(folder / "munge" / "seed"),
                 "--log-file", str(folder / "log" / "munged.log"), "--force"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            _wait(lambda: munge_socket.exists(), "munged", folder / "log" / "munged.log")
            processes.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True))
            processes.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", "localhost"], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True))
            _wait(lambda: _node_idle(env), "slurmctld/slurmd", folder / "log" / "slurmctld.log")
            yield Cluster(folder=folder, conf=conf, jobcomp=jobcomp)
        finally:
            for process in reversed(processes):
                stop(process)
            if os.environ.get("RUNNER_SLURM_LOGS"):  # keep the daemons' logs (investigating a failure)
                shutil.copytree(folder / "log", Path(os.environ["RUNNER_SLURM_LOGS"]) / folder.name)


def _node_idle(env: dict[str, str]) -> bool:
    result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env, check=False)
    return result.returncode == 0 and result.stdout.strip().startswith("idle")


def _wait(ready, what: str, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.is_file() else "(no log)"
            raise RuntimeError(f"{what} did not come up in {timeout_s:.0f} s:\n{tail}")
        time.sleep(0.2)
