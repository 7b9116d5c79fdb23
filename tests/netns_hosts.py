"""Test hosts that share nothing but a network: Linux network namespaces joined by veth
pairs on a bridge, each host's processes in a mount and UTS namespace of their own (a
host name of its own and an empty /dev/shm), MPICH's mpiexec reaching them through a
launcher that enters the namespace instead of ssh. Ranks on one such host share memory;
ranks on two reach each other over TCP only, as on two machines.

    python tests/netns_hosts.py --hosts 2 -- commref check --np 4 --path auto

makes the hosts, runs the command with mpiexec aimed at them (HYDRA_HOST_FILE,
HYDRA_LAUNCHER_EXEC: `--np` ranks spread evenly, consecutive ranks on one host), and
takes them down again whatever way the command ends. Needs root (CAP_NET_ADMIN and
CAP_SYS_ADMIN), iproute2 (`ip`) and util-linux (`unshare`); `why_unavailable()` says
what is missing. Names carry this process's id, so that concurrent runs do not meet,
and `remove_stale()` removes what a killed run left (its process gone).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PREFIX = "cr"  # every name: cr<pid>h<i> (namespaces), cr<pid>b (the bridge), cr<pid>v<i> (veths)
SUBNET = "10.77"  # hosts 10.77.<x>.1..n, the bridge .254; <x> from the pid, as the names
MAX_HOSTS = 16
_NAME = re.compile(rf"^{PREFIX}(\d+)[hbv]\d*$")

# The launcher mpiexec runs instead of ssh: `launcher [ssh flags] HOST COMMAND...` runs the
# command (hydra's proxy) inside HOST's namespaces, with the host name and /dev/shm of its own.
_LAUNCHER = """#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
case "$1" in
%(cases)s
  *) echo "netns_hosts launcher: no host $1" >&2; exit 1 ;;
esac
shift
exec ip netns exec "$ns" unshare --mount --uts --propagation private \\
  sh -c "hostname $ns && mount -t tmpfs tmpfs /dev/shm && exec $*"
"""


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")


def why_unavailable() -> str | None:
    """None where hosts can be made here; else the reason, in one line."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (Debian package {package})"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return f"cannot make a network namespace: {e}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Removes the namespaces and bridges of runs whose process is gone; returns their names."""
    removed = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    names = [line.split()[0] for line in netns.splitlines() if line.strip()]
    names += [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", links, re.M)]
    for name in names:
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            kind = ["ip", "netns", "del", name] if name in netns.split() else ["ip", "link", "del", name]
            subprocess.run(kind, capture_output=True, timeout=30)
            removed.append(name)
    return removed


class NetnsHosts:
    """`hosts` namespace hosts with `ranks_per_host` slots each, made on entry and taken
    down on exit (also after an exception). `env()`: what mpiexec needs to start a job's
    ranks on them; `names`: the hosts' names (their host names inside)."""

    def __init__(self, hosts: int, ranks_per_host: int):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be from 1 to {MAX_HOSTS}, not {hosts}")
        if ranks_per_host < 1:
            raise ValueError(f"ranks per host must be at least 1, not {ranks_per_host}")
        self.hosts, self.ranks_per_host = hosts, ranks_per_host
        tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{tag}b"
        self.names = [f"{tag}h{i}" for i in range(hosts)]
        self._veths = [f"{tag}v{i}" for i in range(hosts)]
        net = os.getpid() % 250
        self.addresses = [f"{SUBNET}.{net}.{i + 1}" for i in range(hosts)]
        self._gateway = f"{SUBNET}.{net}.254"
        self._dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> NetnsHosts:
        try:
            self._up()
        except BaseException:
            self._down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._down()

    def _up(self) -> None:
        for name in (self.bridge, *self._veths):
            if len(name) > 15:
                raise RuntimeError(f"interface name {name} is longer than Linux allows (15)")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self._gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for ns, veth, address in zip(self.names, self._veths, self.addresses):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "route", "add", "default", "via", self._gateway)
        self._dir = tempfile.TemporaryDirectory(prefix="commref-netns-")
        d = Path(self._dir.name)
        (d / "hosts").write_text("".join(f"{a}:{self.ranks_per_host}\n" for a in self.addresses))
        cases = "\n".join(f"  {a}) ns={ns} ;;" for a, ns in zip(self.addresses, self.names))
        launcher = d / "launcher"
        launcher.write_text(_LAUNCHER % {"cases": cases})
        launcher.chmod(0o755)

    def _down(self) -> None:
        """Kills what still runs inside a host, then removes the veths (each pair with its
        end inside), the namespaces and the bridge."""
        for ns in self.names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for veth in self._veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this environment) with mpiexec aimed at the hosts."""
        assert self._dir is not None, "the hosts are not up"
        env = dict(os.environ if base is None else base)
        env.update(
            HYDRA_HOST_FILE=str(Path(self._dir.name) / "hosts"),
            HYDRA_LAUNCHER="ssh",
            HYDRA_LAUNCHER_EXEC=str(Path(self._dir.name) / "launcher"),
            HYDRA_IFACE=self.bridge,
        )
        return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help=f"hosts to make (1..{MAX_HOSTS}; default 2)")
    parser.add_argument("--ranks-per-host", type=int, default=2, help="slots per host (default 2)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to run with the hosts up")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    why = why_unavailable()
    if why is not None:
        print(f"netns_hosts: {why}", file=sys.stderr)
        return 2
    remove_stale()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with NetnsHosts(args.hosts, args.ranks_per_host) as hosts:
            return subprocess.run(command, env=hosts.env()).returncode
    except ValueError as e:
        print(f"netns_hosts: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
