"""Separate "hosts" made of Linux network namespaces, joined by a bridge.

A :class:`Network` creates one namespace holding a Linux bridge and, per
:meth:`Network.add_host`, one namespace joined to the bridge by a veth pair,
with an address from the benchmarking range 198.18.0.0/15 that exists only
inside these namespaces. A link can be limited in both directions with a
``tbf`` qdisc. Processes run inside a host with :meth:`Host.popen` (``ip netns
exec``); every one is terminated by its pid when the network closes, and every
namespace is then deleted and checked gone::

    with Network() as net:
        a, b = net.add_host("server", rate_mbit=1000), net.add_host("worker")
        server = a.serve("--workers", "1", env={"APS_TOKEN": "t"})
        proc = b.popen([sys.executable, "worker.py", server.address])

The veth and bridge interfaces are created directly inside the network's own
namespaces (never in the caller's), so their names only need to be unique
within a namespace; the namespace names carry the pid and a per-process
counter (``apsnet-PID-N-br``, ``apsnet-PID-N-hI``), so parallel runs never
collide and leftovers of a dead run are recognised by :func:`cleanup_stale`.

Needs root and iproute2 (``ip``; ``tc`` for rate limits): :func:`require_netns`
skips a test with the reason when they are missing, and
:func:`netns_unavailable_reason` says why without pytest.
"""

from __future__ import annotations

import atexit
import contextlib
import gzip
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aps.testing import ServerProcess

__all__ = [
    "PREFIX",
    "Host",
    "Network",
    "NetnsError",
    "cleanup_stale",
    "list_netns",
    "netns_pids",
    "netns_unavailable_reason",
    "pid_alive",
    "require_netns",
    "tbf_params",
]

#: Every namespace made here is named ``PREFIX-PID-N-...``.
PREFIX = "apsnet"
#: Seconds any single ``ip``/``tc`` command may take.
CMD_TIMEOUT = 10.0
#: Seconds a process has to exit after SIGTERM before it gets SIGKILL.
GRACE = 5.0
#: Where host addresses come from (RFC 2544's benchmarking range).
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
#: The interface names inside the namespaces.
BRIDGE_IF = "br0"
HOST_IF = "eth0"

_NAME_RE = re.compile(rf"^{re.escape(PREFIX)}-(\d+)-(\d+)-[A-Za-z0-9]+$")
_counter = itertools.count(1)
_open_networks: weakref.WeakSet[Network] = weakref.WeakSet()
_stale_swept = False
_probe: dict[bool, str | None] = {}


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed, or a namespace outlived its network."""


# Commands -----------------------------------------------------------------
def _run(argv: Sequence[str], timeout: float = CMD_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    """Run one command with a timeout; NetnsError (with its stderr) when it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(argv)}: no answer in {timeout} s") from None
    except OSError as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from None
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def list_netns() -> list[str]:
    """The names of every named network namespace (``ip netns list``)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    """The pids of the processes inside namespace ``netns`` (``ip netns pids``)."""
    done = _ip("netns", "pids", netns, check=False)
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an ended process not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _terminate_pids(pids: Sequence[int], grace: float) -> None:
    """SIGTERM each pid, then SIGKILL those still there after ``grace`` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _runtime_dir(netns: str) -> str:
    return os.path.join(tempfile.gettempdir(), netns)


def _delete_netns(netns: str, grace: float) -> None:
    """Terminate what still runs in ``netns``, delete it and its runtime directory."""
    leftover = [pid for pid in netns_pids(netns) if pid != os.getpid()]
    if leftover:
        _terminate_pids(leftover, grace)
    _ip("netns", "delete", netns, check=False)
    shutil.rmtree(_runtime_dir(netns), ignore_errors=True)


def cleanup_stale(grace: float = GRACE) -> list[str]:
    """Delete the namespaces (and the processes in them) left by dead processes.

    Only names of this module's form ``PREFIX-PID-N-...`` whose PID is no longer
    alive are touched. Returns the names deleted.
    """
    deleted = []
    for name in list_netns():
        match = _NAME_RE.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or pid_alive(pid):
            continue
        _delete_netns(name, grace)
        deleted.append(name)
    return deleted


# Availability -------------------------------------------------------------
def netns_unavailable_reason(shaping: bool = False) -> str | None:
    """Why namespaces (and with ``shaping``, tbf rate limits) cannot be used here, or None.

    Probes once per process: creates a namespace with a bridge and a veth pair
    (and a tbf qdisc), then deletes it.
    """
    if shaping not in _probe:
        _probe[shaping] = _find_unavailable(shaping)
    return _probe[shaping]


def _find_unavailable(shaping: bool) -> str | None:
    if not hasattr(os, "geteuid") or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc") if shaping else ("ip",):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    name = f"{PREFIX}-{os.getpid()}-0-probe"
    steps = [
        ("netns", "add", name),
        ("-n", name, "link", "set", "lo", "up"),
        ("-n", name, "link", "add", "pbr", "type", "bridge"),
        ("-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb"),
        ("-n", name, "link", "set", "pa", "master", "pbr"),
    ]
    try:
        for step in steps:
            try:
                _ip(*step)
            except NetnsError as exc:
                return f"cannot set up a network namespace here: {exc}"
        if shaping:
            try:
                _run(["tc", "-n", name, "qdisc", "add", "dev", "pa", "root", *tbf_params(100)])
            except NetnsError as exc:
                return f"cannot add a tbf qdisc here: {exc}"
        return None
    finally:
        _ip("netns", "delete", name, check=False)


def require_netns(shaping: bool = False) -> None:
    """``pytest.skip`` the calling test, with the reason, when namespaces (or tbf) are unusable."""
    reason = netns_unavailable_reason(shaping)
    if reason is not None:
        import pytest

        pytest.skip(reason)


# Shaping ------------------------------------------------------------------
def kernel_hz() -> int:
    """The kernel's CONFIG_HZ from its config, or 100 (the lowest, so the largest bursts) when unknown."""
    release = os.uname().release
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{release}", open)):
        try:
            with opener(path, "rt") as fh:
                for line in fh:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=", 1)[1])
        except (OSError, ValueError):
            continue
    return 100


def tbf_params(rate_mbit: float, latency_ms: float = 20.0, burst: int | None = None) -> list[str]:
    """``tc`` arguments of a tbf qdisc limiting to ``rate_mbit`` Mbit/s.

    By default the bucket holds one timer tick's worth of the rate (so the rate
    is reached at the kernel's HZ even without high-resolution timers), and at
    least two 64 KiB GSO packets (so offloaded segments pass whole);
    ``latency_ms`` bounds the queue. ``burst`` (bytes, at least 2 x 64 KiB)
    sets the bucket instead: a bucket of a tick's worth (500 KB at 1 Gbit/s
    and HZ 250) lets a message of a few hundred KB through at the speed of
    memory after every pause, so a link of messages with gaps between them
    carries more than its rate; 128 KiB holds the rate with the hrtimers every
    current kernel's tbf uses.
    """
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be positive, not {rate_mbit}")
    if burst is not None and burst < 2 * 65536:
        raise ValueError(f"a tbf burst of {burst} bytes cannot pass two 64 KiB GSO packets")
    rate_bytes = rate_mbit * 1e6 / 8
    if burst is None:
        burst = max(int(rate_bytes / kernel_hz()), 2 * 65536)
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst), "latency", f"{latency_ms}ms"]


# Hosts and networks -------------------------------------------------------
class Host:
    """One namespace on the network: ``address`` on its ``eth0``, and processes run in it.

    Attributes:
        name: the label given to :meth:`Network.add_host`.
        netns: the namespace's name (for ``ip netns exec``/``ip -n``).
        address: its IPv4 address (no prefix length).
        bridge_port: the veth end in the bridge namespace that leads here.
        rate_mbit: the link's limit in each direction, or None.
        runtime_dir: a directory of this host's own (servers put their Unix sockets there).
    """

    def __init__(self, network: Network, name: str, index: int, address: str) -> None:
        self.network = network
        self.name = name
        self.index = index
        self.netns = f"{network.name}-h{index}"
        self.address = address
        self.bridge_port = f"h{index}"
        self.interface = HOST_IF
        self.rate_mbit: float | None = None
        self.runtime_dir = _runtime_dir(self.netns)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns={self.netns})"

    @property
    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this host (``ip`` by its full path,
        so an ``env`` without PATH still finds it)."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.netns]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(argv, **kwargs)`` inside this host, tracked by the network.

        The environment passes through (``ip netns exec`` execs in place, so the
        pid is the command's own). The process is terminated when the network
        closes; read its pipes before that.
        """
        return self.network._popen(self, [*self.exec_prefix, *argv], **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 30.0, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to completion (killed after ``timeout`` s); output captured as text."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("text", True)
        proc = self.popen(argv, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def serve(self, *args: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> ServerProcess:
        """A real ``aps serve`` in this host, listening on :attr:`address` (port 0 unless given).

        Returns a :class:`aps.testing.ServerProcess`; it is stopped when the
        network closes, if not before. A non-loopback address needs ``--token``
        (or ``APS_TOKEN`` in ``env``) or ``--insecure``. The server's Unix socket
        goes to :attr:`runtime_dir` (``XDG_RUNTIME_DIR``), so servers in
        different hosts on the same port never share a path.
        """
        from aps.testing import ServerProcess

        full_env = {"XDG_RUNTIME_DIR": self.runtime_dir, **(env or {})}
        server = ServerProcess(*args, env=full_env, timeout=timeout, host=self.address, popen=self.popen)
        self.network._servers.append(server)
        return server

    def ip(self, *args: str) -> str:
        """``ip -n NETNS ARGS...``; its output."""
        return _ip("-n", self.netns, *args).stdout

    def mtu(self, bridge_side: bool = False) -> int:
        """The MTU of this host's veth (or with ``bridge_side``, of its peer on the bridge)."""
        netns, dev = (self.network.bridge_netns, self.bridge_port) if bridge_side else (self.netns, self.interface)
        (link,) = json.loads(_ip("-j", "-n", netns, "link", "show", "dev", dev).stdout)
        return int(link["mtu"])

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of both ends of this host's link: {"host": ..., "bridge": ...}."""
        return {
            "host": _run(["tc", "-n", self.netns, "qdisc", "show", "dev", self.interface]).stdout,
            "bridge": _run(["tc", "-n", self.network.bridge_netns, "qdisc", "show", "dev", self.bridge_port]).stdout,
        }

    def set_rate(self, rate_mbit: float | None, burst: int | None = None) -> None:
        """Limit this host's link to ``rate_mbit`` Mbit/s each way (tbf on both veth ends, its
        bucket ``burst`` bytes: see :func:`tbf_params`); None lifts it."""
        ends = ((self.netns, self.interface), (self.network.bridge_netns, self.bridge_port))
        for netns, dev in ends:
            if rate_mbit is None:
                if self.rate_mbit is not None:
                    _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])
            else:
                _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *tbf_params(rate_mbit, burst=burst)])
        self.rate_mbit = rate_mbit


class Network:
    """A bridge namespace and host namespaces on ``subnet``; a context manager.

    On exit (normal, exception or KeyboardInterrupt) every server and process
    started through its hosts is terminated by pid (SIGTERM, SIGKILL after
    ``grace`` s), then every namespace is deleted and checked gone.

    Args:
        subnet: the hosts' IPv4 subnet, inside 198.18.0.0/15; host ``i`` gets
            its ``i``-th address (198.18.0.1, .2, ...).
        mtu: the MTU of every veth and the bridge (the kernel's 1500 if None).
        grace: seconds between SIGTERM and SIGKILL at exit.
        max_hosts: how many hosts :meth:`add_host` allows.
    """

    def __init__(
        self, subnet: str = "198.18.0.0/24", *, mtu: int | None = None, grace: float = GRACE, max_hosts: int = 8
    ) -> None:
        self.subnet = ipaddress.ip_network(subnet)
        if not self.subnet.subnet_of(BENCHMARK_RANGE):  # type: ignore[arg-type]
            raise ValueError(f"subnet {subnet} is not inside {BENCHMARK_RANGE}")
        self.name = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.bridge_netns = f"{self.name}-br"
        self.mtu = mtu
        self.grace = grace
        self.max_hosts = max_hosts
        self.hosts: list[Host] = []
        self.namespaces: list[str] = []  # every namespace this network made (or tried to)
        self._addresses = self.subnet.hosts()
        self._procs: list[subprocess.Popen] = []
        self._servers: list[ServerProcess] = []
        self._lock = threading.Lock()
        self._open = False
        self._closed = False

    def __repr__(self) -> str:
        return f"Network({self.name}, hosts={self.hosts})"

    # Life cycle -----------------------------------------------------------
    def __enter__(self) -> Network:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        interrupted = self.close(defer_sigint=True)
        if interrupted and exc_type is None:
            raise KeyboardInterrupt

    def open(self) -> None:
        """Create the bridge namespace (once); sweeps stale namespaces of dead runs first."""
        global _stale_swept
        if self._open:
            return
        if self._closed:
            raise NetnsError(f"{self.name} is closed")
        if not _stale_swept:
            _stale_swept = True
            cleanup_stale(self.grace)
        self._open = True
        _open_networks.add(self)
        try:
            self._add_netns(self.bridge_netns)
            br = ("-n", self.bridge_netns)
            _ip(*br, "link", "add", BRIDGE_IF, "type", "bridge")
            if self.mtu is not None:
                _ip(*br, "link", "set", BRIDGE_IF, "mtu", str(self.mtu))
            _ip(*br, "link", "set", BRIDGE_IF, "up")
        except BaseException:
            with contextlib.suppress(NetnsError):  # the first error is the one to see
                self.close()
            raise

    def _add_netns(self, netns: str) -> None:
        self.namespaces.append(netns)
        _ip("netns", "add", netns)
        _ip("-n", netns, "link", "set", "lo", "up")

    def add_host(self, name: str, rate_mbit: float | None = None, burst: int | None = None) -> Host:
        """A new host namespace joined to the bridge; its link limited to ``rate_mbit``
        Mbit/s in each direction when given (a tbf bucket of ``burst`` bytes: :func:`tbf_params`)."""
        if not self._open or self._closed:
            raise NetnsError(f"{self.name} is not open (use it as a context manager)")
        if len(self.hosts) >= self.max_hosts:
            raise NetnsError(f"{self.name} already has {self.max_hosts} hosts (max_hosts)")
        if rate_mbit is not None:
            reason = netns_unavailable_reason(shaping=True)
            if reason is not None:
                raise NetnsError(reason)
        host = Host(self, name, len(self.hosts) + 1, str(next(self._addresses)))
        self.hosts.append(host)
        self._add_netns(host.netns)
        br, hn = ("-n", self.bridge_netns), ("-n", host.netns)
        _ip(*br, "link", "add", host.bridge_port, "type", "veth", "peer", "name", host.interface, "netns", host.netns)
        if self.mtu is not None:
            _ip(*br, "link", "set", host.bridge_port, "mtu", str(self.mtu))
            _ip(*hn, "link", "set", host.interface, "mtu", str(self.mtu))
        _ip(*br, "link", "set", host.bridge_port, "master", BRIDGE_IF)
        _ip(*br, "link", "set", host.bridge_port, "up")
        _ip(*hn, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.interface)
        _ip(*hn, "link", "set", host.interface, "up")
        os.makedirs(host.runtime_dir, mode=0o700, exist_ok=True)
        if rate_mbit is not None:
            host.set_rate(rate_mbit, burst)
        return host

    def _popen(self, host: Host, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        with self._lock:
            if not self._open or self._closed:
                raise NetnsError(f"{self.name} is not open")
            proc = subprocess.Popen(argv, **kwargs)
            self._procs.append(proc)
            return proc

    def close(self, defer_sigint: bool = False) -> bool:
        """Stop every process started here, delete every namespace, check none is left.

        With ``defer_sigint`` (in the main thread), a Ctrl-C during the cleanup
        is held until it ends; returns whether one came.
        """
        with _sigint_held(defer_sigint) as interrupted:
            self._close()
        return bool(interrupted)

    def _close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
        _open_networks.discard(self)
        errors = []
        try:
            self._stop_processes()
        except Exception as exc:  # the namespaces still go
            errors.append(f"stopping processes: {exc!r}")
        for netns in reversed(self.namespaces):
            try:
                _delete_netns(netns, self.grace)
            except NetnsError as exc:
                errors.append(str(exc))
        try:
            left = [name for name in list_netns() if name in self.namespaces]
        except NetnsError as exc:
            errors.append(str(exc))
        else:
            if left:
                errors.append(f"namespaces left after deletion: {left}")
        if errors:
            raise NetnsError(f"{self.name}: cleanup incomplete: " + "; ".join(errors))

    def _stop_processes(self) -> None:
        for server in self._servers:
            server.stop(self.grace)
        running = [proc for proc in self._procs if proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(CMD_TIMEOUT)
        for proc in self._procs:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    def alive(self) -> list[subprocess.Popen]:
        """The processes started here that are still running."""
        return [proc for proc in self._procs if proc.poll() is None]


@contextlib.contextmanager
def _sigint_held(hold: bool) -> Iterator[list[int]]:
    """Within the block, SIGINT is recorded in the yielded list instead of raising
    (only when ``hold``, in the main thread, and SIGINT has a Python handler)."""
    caught: list[int] = []
    if not hold or threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:
        yield caught
        return
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


@atexit.register
def _close_open_networks() -> None:
    for network in list(_open_networks):
        with contextlib.suppress(Exception):
            network.close()
