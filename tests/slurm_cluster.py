"""A private one-node SLURM cluster on localhost for the tests: munged, slurmctld and slurmd in a temporary folder.

Nothing under /etc or /run is read or written: every daemon gets its key, socket, config, state, pid and log files
from the temporary folder, and listens on free ports. `start_cluster()` returns a running cluster or raises
ClusterUnavailable with the reason (and the tail of the failing daemon's log) for the test to skip with.
Tested with Debian 12's slurm-wlm 22.05 and munge 0.5.15 (`make slurm` installs them).
"""
from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# slurmd, slurmctld and munged live in /usr/sbin, which is not on a regular user's PATH on Debian.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "scancel", "squeue")
# The project derives the rendezvous port from the job id: 20000 + (last 4 digits) % 10000
# (opencood_ddp/distributed/env.py). Job ids in [10000, 20000) map one-to-one onto ports [20000, 30000).
JOB_PORT_BASE = 20000
PARTITION = "test"


class ClusterUnavailable(RuntimeError):
    """SLURM is not installed or its daemons cannot run here; str() is the reason to skip with."""


def which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def free_port(low: int = 0, high: int = 0) -> int:
    """A TCP port nobody listens on now: any (low=0) or one in [low, high)."""
    for _ in range(200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", random.randrange(low, high) if low else 0))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise ClusterUnavailable(f"no free TCP port in [{low}, {high})")


def tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no {path.name})"
    return f"--- last lines of {path.name}:\n" + "\n".join(text[-lines:])


@dataclass
class Cluster:
    root: Path
    node: str
    cpus: int
    first_job_id: int
    procs: dict = field(default_factory=dict)  # daemon name -> Popen, in start order

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: dict | None = None) -> dict:
        """`base` (default os.environ) for this cluster: SLURM_CONF set, no SLURM_* of an enclosing job."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        return dict(env, SLURM_CONF=str(self.conf), PATH=SEARCH_PATH)

    def run(self, *cmd: str, timeout: float = 10) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env())

    def stop(self) -> None:
        """Cancel every job, wait for the step daemons to go, stop the daemons, delete the folder."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--full", f"--partition={PARTITION}")
            except (OSError, subprocess.SubprocessError):
                pass
        # slurmstepd runs in a session of its own (killing slurmd's would not reach it); it removes its socket
        # <node>_<job>.<step> from SlurmdSpoolDir when its step is over.
        deadline = time.monotonic() + 10
        while any((self.root / "spool").glob(f"{self.node}_*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def node_hardware() -> tuple[str, str, int]:
    """(node name, hardware line for slurm.conf, CPU count) as `slurmd -C` sees this machine.

    The node's name must be the one slurmd finds for itself (the short host name); the topology must not
    exceed what slurmd detects, or slurmctld drains the node as 'Low socket*core*thread count'.
    """
    result = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
    fields = dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)
    if result.returncode != 0 or "NodeName" not in fields or "CPUs" not in fields:
        raise ClusterUnavailable(f"`slurmd -C` failed (exit {result.returncode}): {result.stderr.strip()}")
    # RealMemory is left out: the default (1 MB) can never exceed what slurmd measures.
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    hardware = " ".join(f"{key}={fields[key]}" for key in keys if key in fields)
    return fields["NodeName"], hardware, int(fields["CPUs"])


def write_config(root: Path, node: str, hardware: str, first_job_id: int) -> None:
    user = pwd.getpwuid(os.getuid()).pw_name
    (root / "state").mkdir()
    (root / "spool").mkdir()
    settings = {
        "ClusterName": "opencoodtest",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": free_port(),
        "SlurmdPort": free_port(),
        "SlurmUser": user,
        "SlurmdUser": user,
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={root / 'munge.sock'}",  # our munged, not the system's /run/munge
        "StateSaveLocation": root / "state",
        "SlurmdSpoolDir": root / "spool",
        "SlurmctldPidFile": root / "slurmctld.pid",
        "SlurmdPidFile": root / "slurmd.pid",
        "SlurmctldLogFile": root / "slurmctld.log",
        "SlurmdLogFile": root / "slurmd.log",
        # no cgroups, no accounting, no MPI plugin: nothing that needs a system service or a kernel feature
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "MpiDefault": "none",
        "MailProg": "/bin/true",
        "ReturnToService": 2,
        # the project's derived rendezvous port is 20000 + job id % 10000: start from a free one
        "FirstJobId": first_job_id,
    }
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines.append(f"NodeName={node} NodeAddr=127.0.0.1 {hardware} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP")
    (root / "slurm.conf").write_text("\n".join(lines) + "\n")


def start_cluster(timeout: float = 30) -> Cluster:
    """Start munged, slurmctld and slurmd and wait until the node is idle; ClusterUnavailable if not possible."""
    missing = [name for name in PROGRAMS if which(name) is None]
    if missing:
        raise ClusterUnavailable(f"SLURM is not installed (missing {', '.join(missing)}); "
                                 f"`make slurm` installs Debian's slurm-wlm and munge as root")
    node, hardware, cpus = node_hardware()
    # munged refuses a socket in a folder that not everybody may traverse (pytest's tmp_path is 0700),
    # and a key file that anybody but its owner may read.
    root = Path(tempfile.mkdtemp(prefix="slurm-test-"))
    root.chmod(0o755)
    cluster = Cluster(root, node, cpus, first_job_id=10000 + free_port(JOB_PORT_BASE, JOB_PORT_BASE + 10000)
                      - JOB_PORT_BASE)
    try:
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        write_config(root, node, hardware, cluster.first_job_id)
        commands = {
            "munged": [which("munged"), "--foreground", f"--socket={root / 'munge.sock'}", f"--key-file={key}",
                       f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                       f"--seed-file={root / 'munged.seed'}"],
            # -D: stay in the foreground, so that the Popen handle is the daemon and stop() can reach it
            "slurmctld": [which("slurmctld"), "-D", "-f", str(cluster.conf)],
            "slurmd": [which("slurmd"), "-D", "-f", str(cluster.conf), "-N", node],
        }
        for name, cmd in commands.items():
            with open(root / f"{name}.out", "w") as out:
                cluster.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, env=cluster.env(),
                                                       cwd=root, start_new_session=True)
            if name == "munged":
                wait_for(lambda: (root / "munge.sock").exists(), cluster, "munged", timeout=10)
        state = {"last": ""}

        def idle() -> bool:
            try:  # sinfo waits for an unreachable slurmctld much longer than a poll should
                result = cluster.run("sinfo", "--noheader", "--node", node, "--format=%T", timeout=3)
            except subprocess.TimeoutExpired:
                return False
            state["last"] = (result.stdout + result.stderr).strip()
            return result.returncode == 0 and result.stdout.strip() == "idle"

        wait_for(idle, cluster, "slurmd", timeout=timeout, what=lambda: f"sinfo says {state['last']!r}")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_for(ready, cluster: Cluster, name: str, timeout: float, what=lambda: "") -> None:
    """Poll `ready()`; a daemon that exits or a timeout raises ClusterUnavailable with the logs' tails."""
    deadline = time.monotonic() + timeout
    while True:
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if not dead and ready():
            return
        if dead or time.monotonic() > deadline:
            problem = f"{dead[0]} exited with {cluster.procs[dead[0]].returncode}" if dead else \
                f"{name} not ready after {timeout:.0f} s {what()}"
            # a daemon writes its log file once configured, its console (.out) before that and in the foreground
            logs = "\n".join(tail(log if log.exists() else log.with_suffix(".out"))
                             for log in (cluster.root / f"{n}.log" for n in (dead or cluster.procs)))
            raise ClusterUnavailable(f"the test SLURM cluster did not start: {problem}\n{logs}")
        time.sleep(0.2)
