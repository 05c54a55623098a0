"""Several "hosts" on this one machine: network namespaces on a private bridge.

``Network`` makes, for one test run:

- a bridge namespace ``epdmh<pid>-br`` holding the bridge ``br0``; nothing is
  added to the root namespace's network (no interface, route or address), so
  parallel runs never clash and no traffic can leave the namespaces;
- per host a namespace ``epdmh<pid>-<name>`` with ``lo`` up and ``eth0``, one
  end of a veth pair whose other end (``v-<name>``) is a port of ``br0``, with
  an address in ``10.77.0.0/24`` (private, and only routed inside them);
- per host its own ``/dev/shm``: a directory under the root's tmpfs
  (``/dev/shm/epdmh<pid>/<name>``) that every process started in the host
  sees bind-mounted over ``/dev/shm``, inside a private mount namespace (the
  mount goes when the process does; nothing is mounted in the root mount
  namespace). A directory rather than a fresh tmpfs per process, because every
  process of one host (a service, a later restart, a probe) must see the same
  segments. Two hosts made with ``shm_with=`` share one directory: a pod with
  two containers on one shared memory volume, each with its own network;
- per host its own ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, which ``ip netns
  exec`` bind-mounts over ``/etc/hosts``), rewritten in place by
  ``set_hosts`` so a running resolver sees the change.

``close()`` kills what still runs in the namespaces, deletes them and removes
their files; ``sweep_stale()`` does the same for the names of runs whose pytest
process is gone (a killed run). Processes run as ``Host.wrap(argv)``: ``ip
netns exec`` into the namespace, then ``unshare --mount`` and the bind mount,
then ``exec`` of argv, so the Popen pid is the program itself and
``services.up.Service`` stops it as usual.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

PREFIX = "epdmh"
SUBNET = "10.77.0"
SHM_ROOT = "/dev/shm"
ETC_NETNS = "/etc/netns"
_NAME = re.compile(rf"^{PREFIX}(\d+)-([a-z0-9]+)$")
# Namespace suffixes this module uses itself (the bridge, check_available, netem_unavailable).
_RESERVED = frozenset({"br", "probe", "netem"})

# Bind the host's /dev/shm directory, then become the program.
_ENTER = 'mount --bind "$0" /dev/shm && exec "$@"'


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or forbidden)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed run not yet reaped is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_ns(ns: str, deadline_s: float = 10.0) -> None:
    """SIGKILLs every process in namespace ``ns`` (all of them were started by
    this run into its own uniquely named namespace) until none is left."""
    end = time.monotonic() + deadline_s
    while (pids := _ns_pids(ns)) and time.monotonic() < end:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _remove_ns(ns: str) -> None:
    _kill_ns(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Removes the namespaces, hosts files and /dev/shm directories of earlier
    runs whose pytest process no longer exists. Returns the names removed.
    Call it before this process makes its ``Network``: names carrying this
    process's own pid are stale too (a killed run whose pid was reused)."""
    me = os.getpid()

    def stale(pid: str) -> bool:
        return int(pid) == me or not _pid_alive(int(pid))

    removed = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and stale(m.group(1)):
            _remove_ns(ns)
            removed.append(ns)
    for root in (ETC_NETNS, SHM_ROOT):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            m = _NAME.match(name) or re.match(rf"^{PREFIX}(\d+)$", name)
            if m and stale(m.group(1)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(os.path.join(root, name))
    try:
        os.rmdir(ETC_NETNS)  # only if no other run (or anything else) uses it
    except OSError:
        pass
    return removed


def check_available() -> None:
    """Raises Unavailable, with the reason, where this process cannot make
    network namespaces, veth pairs and private mounts."""
    if os.geteuid() != 0:
        raise Unavailable("needs root (network namespaces, veth pairs, mounts)")
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise Unavailable(f"`{tool}` is not installed")
    ns = f"{PREFIX}{os.getpid()}-probe"
    try:
        proc = _ip("netns", "add", ns, check=False)
        if proc.returncode != 0:
            raise Unavailable(f"`ip netns add` fails here: {proc.stderr.strip()}")
        steps = [["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                 ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private",
                  "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]]
        for argv in steps:
            proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
            if proc.returncode != 0:
                raise Unavailable(f"`{' '.join(argv[3:] if argv[1] == 'netns' else argv)}` fails here: "
                                  f"{proc.stderr.strip()}")
    finally:
        _ip("netns", "del", ns, check=False)


def netem_unavailable() -> str:
    """Why ``tc ... netem`` cannot be used here ("" when it can)."""
    if shutil.which("tc") is None:
        return "`tc` is not installed"
    ns = f"{PREFIX}{os.getpid()}-netem"
    try:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True, text=True, check=False, timeout=30)
        if proc.returncode != 0:
            return f"this kernel has no sch_netem (`tc qdisc add ... netem`: {proc.stderr.strip()})"
        return ""
    finally:
        _ip("netns", "del", ns, check=False)


@dataclass(eq=False)
class Host:
    """One machine: its own network stack, address, /dev/shm and /etc/hosts."""

    net: Network
    name: str
    ip: str
    shm_dir: str

    @property
    def ns(self) -> str:
        return f"{self.net.run}-{self.name}"

    @property
    def bridge_port(self) -> str:
        """The bridge-side end of this host's link (in the bridge namespace)."""
        return f"v-{self.name}"

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host: its network, its /dev/shm and /etc/hosts."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", _ENTER, self.shm_dir, *argv]

    def wrap_net(self, argv: list[str]) -> list[str]:
        """``argv`` in this host's network only, seeing the root's /dev/shm: for a
        process that itself starts processes in other hosts (their ``wrap`` binds
        a directory of the root's /dev/shm, which this host's own bind would hide)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(argv), capture_output=True, text=True, check=False, timeout=timeout, **kw)

    def ip_cmd(self, *args: str) -> None:
        """``ip`` (or ``tc``: first argument "tc") in this host's network namespace."""
        argv = ["ip", "netns", "exec", self.ns, *args]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} in {self.name}: {proc.stderr.strip()}")

    def set_link(self, up: bool) -> None:
        """Cuts (or restores) this host's only link, at the bridge port: its
        packets are dropped, no reset is sent (a pulled cable)."""
        _ip("-n", self.net.bridge_ns, "link", "set", self.bridge_port, "up" if up else "down")

    def set_qdisc(self, *spec: str) -> None:
        """``tc qdisc replace dev eth0 root <spec>`` (this host's egress); no spec: back to the default."""
        if spec:
            self.ip_cmd("tc", "qdisc", "replace", "dev", "eth0", "root", *spec)
        else:
            subprocess.run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, check=False, timeout=30)

    def throttle_port(self, sport: int, rate: str, *, drop: bool = False) -> None:
        """Slows only what this host sends from TCP port ``sport`` to ``rate`` (an htb class with a
        u32 filter); everything else it sends goes at full speed. ``drop``: drops all of it instead
        (a pfifo of limit 0 under that class; no extra kernel module). ``set_qdisc()`` undoes it.
        A slow rate is not a slow transfer: veth hands htb large segments and htb lets a whole one
        out while its bucket is positive."""
        dev = ["dev", "eth0"]
        self.ip_cmd("tc", "qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "10")
        self.ip_cmd("tc", "class", "add", *dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
        self.ip_cmd("tc", "class", "add", *dev, "parent", "1:", "classid", "1:20", "htb", "rate", rate,
                    "burst", "1600")
        if drop:  # before the filter, so nothing slips through meanwhile
            self.ip_cmd("tc", "qdisc", "add", *dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
        self.ip_cmd("tc", "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                    "match", "ip", "sport", str(sport), "0xffff", "flowid", "1:20")

    def black_hole_port(self, sport: int) -> None:
        """Drops everything this host sends from TCP port ``sport`` (no reset: the peer's calls on
        it hang); everything else goes at full speed. ``set_qdisc()`` undoes it."""
        self.throttle_port(sport, "8kbit", drop=True)

    def set_hosts(self, names: dict[str, list[str]]) -> None:
        """This host's /etc/hosts: localhost plus ``name -> addresses``. Written
        in place (same inode), so processes already running, whose /etc/hosts is
        a bind mount of this file, resolve the new addresses on their next lookup."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{addr} {name}" for name, addrs in names.items() for addr in addrs]
        path = os.path.join(ETC_NETNS, self.ns, "hosts")
        # Overwrite, then cut the tail: never empty for a concurrent reader. No temp file and rename:
        # running processes see the bind-mounted inode, not the path.
        with open(path, "r+" if os.path.exists(path) else "w") as f:
            f.seek(0)
            f.write("\n".join(lines) + "\n")
            f.truncate()

    def pids(self) -> list[int]:
        return _ns_pids(self.ns)

    def kill_all(self) -> None:
        """SIGKILL to every process of this host (a machine that dies)."""
        _kill_ns(self.ns)


@dataclass
class Network:
    """The hosts of one test run; ``close()`` removes everything it made."""

    run: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"{self.run}-br"

    @property
    def shm_root(self) -> str:
        return os.path.join(SHM_ROOT, self.run)

    def start(self) -> Network:
        os.makedirs(self.shm_root, mode=0o700, exist_ok=False)
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def add_host(self, name: str, shm_with: Host | None = None) -> Host:
        """A new host on the bridge, with the next free address. ``shm_with``:
        share that host's /dev/shm (two containers of one pod)."""
        if not re.match(r"^[a-z0-9]{1,10}$", name) or name in self.hosts or name in _RESERVED:
            raise ValueError(f"host name {name!r}: 1-10 of a-z0-9, unique, not one of {sorted(_RESERVED)}")
        ip = f"{SUBNET}.{10 + len(self.hosts)}"
        shm_dir = shm_with.shm_dir if shm_with else os.path.join(self.shm_root, name)
        os.makedirs(shm_dir, mode=0o1777, exist_ok=True)
        os.chmod(shm_dir, 0o1777)  # as /dev/shm itself
        host = Host(self, name, ip, shm_dir)
        self._add_ns(host.ns)
        os.makedirs(os.path.join(ETC_NETNS, host.ns), exist_ok=True)
        host.set_hosts({})
        _ip("-n", host.ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge_ns, "link", "add", host.bridge_port, "type", "veth", "peer", "name", "eth0",
            "netns", host.ns)
        _ip("-n", self.bridge_ns, "link", "set", host.bridge_port, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", host.bridge_port, "up")
        _ip("-n", host.ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def close(self) -> None:
        """Kills what runs in the hosts and deletes every namespace, hosts file
        and /dev/shm directory of this run. Safe to call twice."""
        for ns in reversed(self._made):
            _remove_ns(ns)
        self._made.clear()
        shutil.rmtree(self.shm_root, ignore_errors=True)
        try:
            os.rmdir(ETC_NETNS)
        except OSError:
            pass

    def leftovers(self) -> list[str]:
        """What of this run still exists (empty after ``close``)."""
        left = [ns for ns in _namespaces() if ns.startswith(self.run + "-")]
        left += [p for p in (self.shm_root,) if os.path.exists(p)]
        left += [os.path.join(ETC_NETNS, n) for n in (os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else [])
                 if n.startswith(self.run + "-")]
        return left
