"""A real Slurm cluster on this one machine, started and torn down by a test.

:class:`SlurmCluster` runs one ``slurmctld`` and N ``slurmd`` "nodes", each as a
plain process (no systemd) inside its own host of a
:class:`aps.testing.netns.Network`: its own network namespace with its own
address on a private bridge (198.18.0.0/24, reachable only inside those
namespaces), its own hostname (a UTS namespace: ``hostname`` prints the node's
name) and its own ``/etc/hosts`` naming every host of the cluster (bind-mounted
inside the private mount namespace ``ip netns exec`` makes, so the machine's file
is untouched). A private ``munged`` (its own key, its socket in the cluster's
directory, named in the config's ``AuthInfo``) authenticates them; Unix sockets
on the filesystem cross network namespaces, so one ``munged`` serves all::

    with SlurmCluster(nodes=3, cpus_per_node=2) as cluster:
        job = cluster.sbatch("job.sh", env={"APS_TOKEN": token})
        assert cluster.wait(job, timeout=120) == "COMPLETED"
        print(open(cluster.output_path(job)).read())

Config, state, spool, logs, pid files and the munge key all live in one temporary
directory (:attr:`SlurmCluster.root`, logs in :attr:`SlurmCluster.log_dir`),
removed at exit unless ``keep`` (kept, and named in the error, when the start
fails: the daemons' logs say why). On exit (normal or not) every daemon is
stopped by its pid (SIGTERM, then SIGKILL after ``grace`` s), then the
network's namespaces are deleted, which also ends whatever the jobs left
running in them (``slurmstepd``, tasks). System services and files are never
touched.

Why namespaces: Debian's Slurm 22.05 is built with multiple-slurmd support
(``scontrol show config``: ``MULTIPLE_SLURMD = Yes``), so several ``slurmd -N
NAME`` with distinct ports on one host would also run, but every node would
then share one address and one hostname. With one namespace per node, every
node has its own address and hostname and the same ``SlurmdPort``, which is
what a real cluster looks like to a job: tasks on different nodes reach each
other over TCP at the addresses their node names resolve to (the names
``scontrol show hostnames $SLURM_JOB_NODELIST`` prints resolve inside every
host), as a parameter server on one node and its workers on others need. The
daemons' ports live in the namespaces, so a system Slurm on the machine (or a
second cluster of a parallel test) never collides with one of these.

Two things ``ip netns exec`` changes, and how they are met: it mounts a fresh
sysfs, hiding ``/sys/fs/cgroup``, where slurmd 22.05 (which loads a cgroup
plugin whatever the config) autodetects the cgroup version and fails; the
cluster's ``cgroup.conf`` names ``cgroup/v1`` with an empty mount point of its
own (nothing is constrained, so it stays unused). And its private mount
namespace is what lets each host bind its own ``/etc/hosts``.

The controller runs in its own host ``ctl``, which the caller's network
namespace cannot reach: Slurm's commands (``sbatch``, ``scontrol``, ``squeue``,
``sinfo``, ``scancel``, ``srun``) must run in it, with ``SLURM_CONF`` set:
:meth:`SlurmCluster.run` does both (argv prefix :attr:`SlurmCluster.exec_prefix`,
environment :attr:`SlurmCluster.env`). So must anything else that talks to a
job's processes (a client of a server a job runs): :meth:`SlurmCluster.popen`
starts it in a host of the cluster (``ctl`` unless told), where node names
resolve; it is ended at exit if still running. There is no accounting (no ``sacct``):
:meth:`SlurmCluster.wait` polls ``scontrol show job`` (records are kept
``MinJobAge`` = 600 s after a job ends).

Needs root, iproute2, util-linux (``unshare``, ``mount``), ``hostname`` and
Debian's ``slurmctld slurmd slurm-client munge``: :func:`require_slurm` skips a
test with the reason when something is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aps.testing.netns import Host, Network, netns_unavailable_reason, pid_alive

__all__ = [
    "SlurmCluster",
    "SlurmError",
    "TERMINAL_STATES",
    "parse_record",
    "require_slurm",
    "slurm_unavailable_reason",
]

#: The programs a cluster runs (daemons, then commands).
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
COMMANDS = ("sbatch", "scontrol", "sinfo", "srun", "scancel", "unshare", "mount", "hostname")
#: Where daemons live when PATH lacks the sbin directories.
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
#: The states a job ends in (``scontrol show job``'s JobState).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
#: Seconds any single Slurm command may take.
CMD_TIMEOUT = 30.0
#: Environment variables of an enclosing Slurm job that would confuse the cluster's commands.
_FOREIGN = re.compile(r"^(SLURM|SBATCH|SRUN|SALLOC|SQUEUE|SINFO|SCONTROL)_")
#: Inside a host: set the hostname, put the cluster's hosts file over /etc/hosts (in the
#: private mount namespace of ``ip netns exec``), then exec the command (same pid throughout).
_WRAPPER = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'


class SlurmError(RuntimeError):
    """The cluster did not start, a command failed, or a job did not end in time."""


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN])
    return shutil.which(name, path=path)


def slurm_unavailable_reason() -> str | None:
    """Why a :class:`SlurmCluster` cannot run here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        uid = os.geteuid() if hasattr(os, "geteuid") else "?"
        return f"a Slurm cluster in network namespaces needs root (running as uid {uid})"
    missing = [name for name in (*DAEMONS, *COMMANDS) if _which(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    reason = netns_unavailable_reason()
    if reason is not None:
        return reason
    return None


def require_slurm() -> None:
    """``pytest.skip`` the calling test, with the reason, when a cluster cannot run here."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(reason)


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError as exc:
        return f"({exc})\n"


def parse_record(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show -o`` record (values without spaces)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][\w:/]*)=(\S*)", text))


class SlurmCluster:
    """One ``slurmctld`` and ``nodes`` ``slurmd`` in network namespaces; a context manager.

    Args:
        nodes: how many compute nodes (``node1`` ... ``nodeN``).
        cpus_per_node: the CPUs each node declares (may exceed the machine's:
            ``SlurmdParameters=config_overrides``).
        partition: the one (default) partition's name.
        start_timeout: seconds for every node to be idle after the daemons start.
        grace: seconds between SIGTERM and SIGKILL at exit.
        keep: leave :attr:`root` (config, logs, job outputs) in place at exit.
        subnet: the hosts' subnet (inside 198.18.0.0/15); ``ctl`` gets its first address.
        debug: ``SlurmctldDebug``/``SlurmdDebug``.

    Attributes (once entered):
        root: the cluster's directory; conf: its slurm.conf; log_dir: daemon logs;
        job_dir: the default working directory of submitted jobs (their
        ``slurm-JOBID.out`` goes there); nodes: the node names; addresses:
        name -> IPv4 address (``ctl`` included); env: the environment for Slurm's
        commands (this process's, less any ``SLURM_*`` of an enclosing job, plus
        ``SLURM_CONF``); controller / hosts: the :class:`~aps.testing.netns.Host` objects.
    """

    def __init__(
        self,
        nodes: int = 3,
        cpus_per_node: int = 2,
        *,
        partition: str = "debug",
        start_timeout: float = 60.0,
        grace: float = 5.0,
        keep: bool = False,
        subnet: str = "198.18.0.0/24",
        debug: str = "info",
    ) -> None:
        if nodes < 1 or cpus_per_node < 1:
            raise ValueError("nodes and cpus_per_node must be at least 1")
        self.node_count = nodes
        self.cpus_per_node = cpus_per_node
        self.partition = partition
        self.start_timeout = start_timeout
        self.grace = grace
        self.keep = keep
        self.subnet = subnet
        self.debug = debug
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.root = ""
        self.conf = ""
        self.log_dir = ""
        self.job_dir = ""
        self.hosts_file = ""
        self.munge_socket = ""
        self.addresses: dict[str, str] = {}
        self.env: dict[str, str] = {}
        self.controller: Host | None = None
        self.hosts: dict[str, Host] = {}
        self.started_in: float | None = None
        self._net: Network | None = None
        self._daemons: list[tuple[str, subprocess.Popen]] = []  # (label, process), in start order

    def __repr__(self) -> str:
        return f"SlurmCluster(nodes={self.nodes}, root={self.root!r})"

    # Life cycle -----------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def start(self) -> None:
        """Make the directory, the hosts, the config; start munged, slurmctld, every slurmd;
        wait (``start_timeout``) until every node is idle. Cleans up after itself on failure."""
        reason = slurm_unavailable_reason()
        if reason is not None:
            raise SlurmError(reason)
        began = time.monotonic()
        try:
            self._prepare()
            self._start_munged()
            self._start_daemons()
            self._wait_idle(began + self.start_timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.close(failed=True)
            raise
        self.started_in = time.monotonic() - began

    def _prepare(self) -> None:
        self.root = tempfile.mkdtemp(prefix="aps-slurm-")
        # munged wants every directory above its socket searchable by all, and its
        # key's directory private.
        os.chmod(self.root, 0o755)
        layout = {
            "etc": 0o755,
            "munge": 0o755,
            "munge/key": 0o700,
            "state": 0o700,
            "spool": 0o755,
            "log": 0o755,
            "run": 0o755,
            "jobs": 0o755,
            "cgroup": 0o755,
            **{f"spool/{name}": 0o755 for name in self.nodes},
        }
        for sub, mode in layout.items():
            os.mkdir(os.path.join(self.root, sub), mode)
            os.chmod(os.path.join(self.root, sub), mode)
        self.log_dir = os.path.join(self.root, "log")
        self.job_dir = os.path.join(self.root, "jobs")
        self.munge_socket = os.path.join(self.root, "munge", "munge.sock")
        key = os.path.join(self.root, "munge", "key", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))

        self._net = Network(self.subnet, grace=self.grace, max_hosts=self.node_count + 1)
        self._net.open()
        self.controller = self._net.add_host("ctl")
        self.addresses = {"ctl": self.controller.address}
        for name in self.nodes:
            host = self._net.add_host(name)
            self.hosts[name] = host
            self.addresses[name] = host.address

        self.hosts_file = os.path.join(self.root, "etc", "hosts")
        with open(self.hosts_file, "w") as fh:
            fh.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            for name, address in self.addresses.items():
                fh.write(f"{address}\t{name}\n")
        self.conf = os.path.join(self.root, "etc", "slurm.conf")
        with open(self.conf, "w") as fh:
            fh.write(self._config())
        # slurmd 22.05 always loads a cgroup plugin, autodetecting the version from
        # /sys/fs/cgroup, which `ip netns exec` hides (it mounts a fresh sysfs): name v1 and
        # point it at an empty directory of ours (nothing is constrained, so it stays unused).
        with open(os.path.join(self.root, "etc", "cgroup.conf"), "w") as fh:
            fh.write(
                f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={self.root}/cgroup\nCgroupAutomount=no\n"
                "ConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n"
            )
        env = {k: v for k, v in os.environ.items() if not _FOREIGN.match(k)}
        env["SLURM_CONF"] = self.conf
        self.env = env

    def _config(self) -> str:
        r = self.root
        lines = [
            "# Written by aps.testing.slurm: a throwaway cluster in network namespaces.",
            "ClusterName=aps",
            f"SlurmctldHost=ctl({self.addresses['ctl']})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            f"SlurmctldDebug={self.debug}",
            f"SlurmdDebug={self.debug}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            "InactiveLimit=0",
            "KillWait=5",
            "Waittime=0",
            "MinJobAge=600",
            "MailProg=/bin/true",
            f"NodeName=DEFAULT CPUs={self.cpus_per_node} State=UNKNOWN",
        ]
        for name in self.nodes:
            lines.append(f"NodeName={name} NodeAddr={self.addresses[name]} NodeHostname={name}")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _wrap(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside host ``name`` (to go after the host's ``ip netns exec``)."""
        return [_which("unshare") or "unshare", "--uts", "sh", "-c", _WRAPPER, "sh", name, self.hosts_file, *argv]

    @property
    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a command in the controller's host (as its hostname,
        with the cluster's /etc/hosts); give it :attr:`env` too."""
        assert self.controller is not None, "the cluster is not started"
        return [*self.controller.exec_prefix, *self._wrap("ctl", [])]

    def _spawn(self, label: str, host: Host, argv: Sequence[str]) -> subprocess.Popen:
        out = os.path.join(self.log_dir, f"{label}.out")
        with open(out, "ab") as fh:
            proc = host.popen(
                self._wrap(host.name, argv),
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self._daemons.append((label, proc))
        return proc

    def _start_munged(self) -> None:
        assert self.controller is not None
        key_dir = os.path.join(self.root, "munge", "key")
        self._spawn(
            "munged",
            self.controller,
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key_dir}/munge.key",
                f"--seed-file={key_dir}/munged.seed",
                f"--pid-file={self.root}/run/munged.pid",
                f"--log-file={self.log_dir}/munged.log",
            ],
        )
        self._poll(
            lambda: os.path.exists(self.munge_socket), time.monotonic() + 10.0, "munged did not create its socket"
        )

    def _start_daemons(self) -> None:
        assert self.controller is not None
        self._spawn("slurmctld", self.controller, [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", self.conf])
        for name in self.nodes:
            self._spawn(
                f"slurmd-{name}", self.hosts[name], [_which("slurmd") or "slurmd", "-D", "-N", name, "-f", self.conf]
            )

    def _check_daemons(self) -> None:
        for label, proc in self._daemons:
            if proc.poll() is not None:
                raise SlurmError(f"{label} exited with {proc.returncode}\n{self.diagnostics()}")

    def _poll(self, ready, deadline: float, what: str, interval: float = 0.1) -> None:
        while True:
            self._check_daemons()
            if ready():
                return
            if time.monotonic() >= deadline:
                raise SlurmError(f"{what}\n{self.diagnostics()}")
            time.sleep(interval)

    def node_states(self) -> dict[str, str]:
        """Node name -> its state (``sinfo``'s long form: idle, allocated, down*, ...)."""
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], check=False, timeout=10.0)
        if done.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())

    def _wait_idle(self, deadline: float) -> None:
        def idle() -> bool:
            states = self.node_states()
            return all(states.get(name) == "idle" for name in self.nodes)

        self._poll(idle, deadline, f"not every node idle within {self.start_timeout} s", interval=0.25)

    def close(self, failed: bool = False) -> None:
        """Stop every daemon by pid (slurmd, then slurmctld, then munged), delete the hosts
        (ending whatever jobs left in them), remove :attr:`root` unless ``keep`` (or ``failed``)."""
        errors = []
        for label, proc in reversed(self._daemons):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(self.grace)
                except subprocess.TimeoutExpired:
                    errors.append(f"{label} (pid {proc.pid}) did not die")
        self._daemons.clear()
        if self._net is not None:
            try:
                self._net.close()
            except Exception as exc:
                errors.append(str(exc))
            self._net = None
        if self.root and not (self.keep or failed):
            shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise SlurmError("cleanup incomplete: " + "; ".join(errors))

    def diagnostics(self) -> str:
        """The tails of every daemon's log (for error messages)."""
        parts = [f"(cluster directory {self.root})\n"]
        if self.log_dir and os.path.isdir(self.log_dir):
            for name in sorted(os.listdir(self.log_dir)):
                parts.append(f"--- {name}\n{_tail(os.path.join(self.log_dir, name))}")
        return "".join(parts)

    # Commands -------------------------------------------------------------
    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = CMD_TIMEOUT,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` (e.g. ``["squeue"]``) in the controller's host with :attr:`env` (plus
        ``env``); output captured as text. SlurmError when it fails and ``check``."""
        assert self.controller is not None, "the cluster is not started"
        full_env = {**self.env, **(env or {})}
        try:
            done = self.controller.run(self._wrap("ctl", argv), timeout=timeout, env=full_env, cwd=cwd or self.job_dir)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{shlex.join(argv)}: no answer in {timeout} s") from None
        if check and done.returncode != 0:
            raise SlurmError(f"{shlex.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def popen(
        self, argv: Sequence[str], host: str = "ctl", *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """``subprocess.Popen(argv)`` in host ``host`` (``ctl`` or a node) with :attr:`env`
        (plus ``env``), as that host's hostname, node names resolving; ended at exit."""
        target = self.controller if host == "ctl" else self.hosts[host]
        assert target is not None, "the cluster is not started"
        return target.popen(self._wrap(host, argv), env={**self.env, **(env or {})}, **kwargs)

    def sbatch(self, script_path: str, *args: str, env: Mapping[str, str] | None = None, cwd: str | None = None) -> int:
        """Submit ``script_path`` (``sbatch --parsable ARGS SCRIPT``); its job id.

        The job gets :attr:`env` plus ``env`` (sbatch's ``--export=ALL``) and runs in
        ``cwd`` (default :attr:`job_dir`), where its ``slurm-JOBID.out`` goes unless
        the script says otherwise.
        """
        done = self.run(["sbatch", "--parsable", *args, os.path.abspath(script_path)], env=env, cwd=cwd)
        return int(done.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o JOB_ID`` as a dict (JobState, NodeList, StdOut, ExitCode, ...)."""
        done = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=10.0)
        return parse_record(done.stdout)

    def wait(self, job_id: int, timeout: float = 120.0, interval: float = 0.5) -> str:
        """Poll until job ``job_id`` ends; its final JobState (COMPLETED, FAILED, ...).
        SlurmError (with the daemons' logs) if it has not ended after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        state = "?"
        while True:
            self._check_daemons()
            state = self.job_info(job_id).get("JobState", "?")
            if state in TERMINAL_STATES:
                return state
            if time.monotonic() >= deadline:
                raise SlurmError(f"job {job_id} still {state} after {timeout} s\n{self.diagnostics()}")
            time.sleep(interval)

    def output_path(self, job_id: int) -> str:
        """The path of job ``job_id``'s standard output (``StdOut``)."""
        return self.job_info(job_id)["StdOut"]

    def cancel(self, job_id: int) -> None:
        """``scancel JOB_ID``."""
        self.run(["scancel", str(job_id)])

    def pids(self) -> dict[str, int]:
        """Daemon label (munged, slurmctld, slurmd-NODE) -> its pid."""
        return {label: proc.pid for label, proc in self._daemons}

    @property
    def namespaces(self) -> list[str]:
        """The network namespaces of the cluster's hosts (and their bridge)."""
        return list(self._net.namespaces) if self._net is not None else []

    def alive(self) -> dict[str, bool]:
        """Daemon label -> whether it still runs."""
        return {label: pid_alive(proc.pid) and proc.poll() is None for label, proc in self._daemons}

    def info(self) -> dict[str, Any]:
        """What a test might log: the directory, the addresses, the start time."""
        return {"root": self.root, "addresses": dict(self.addresses), "started_in": self.started_in}
