"""Several hosts on one machine: network namespaces on a bridge of a private test network.

Each host is a network namespace with its own loopback, one address on the bridge, a host
name of its own (``unshare --uts``) and an ``/etc/hosts`` naming every host, which ``ip
netns exec`` mounts over the machine's. Addresses come from 198.18.0.0/15, the range set
aside for network tests (RFC 2544): no traffic leaves the machine. Everything made here is
removed by :meth:`TestNetwork.close`, which also stops every process started here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.18.{net}.{host}"
PREFIX_LENGTH = 24


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass
class Host:
    """One namespace: its name in ``ip netns``, its host name and its address."""

    #: namespace name, unique to this network
    namespace: str
    #: the name other hosts resolve it by, and its own host name
    name: str
    #: its address on the bridge
    address: str


@dataclass
class Process:
    """A process started on a host; ``log`` holds its stdout and stderr."""

    host: Host
    argv: list[str]
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@dataclass
class TestNetwork:
    """Hosts on one bridge; ``add`` a host, ``start`` a process on it, ``close`` all."""

    __test__ = False

    #: folder for logs and each host's /etc/netns files
    workdir: Path
    #: third octet of the addresses, unique per run
    net: int = field(default_factory=lambda: 64 + os.getpid() % 128)
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tag = f"do{os.getpid() % 100000}"
        self.bridge = self.tag
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{PREFIX_LENGTH}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    @property
    def gateway(self) -> str:
        """The test process's own address on the bridge (it queries the backends)."""
        return SUBNET.format(net=self.net, host=1)

    def add(self, name: str) -> Host:
        index = len(self.hosts) + 2
        host = Host(f"{self.tag}-{name}", name, SUBNET.format(net=self.net, host=index))
        outside = f"{self.tag}v{index}"
        _ip("netns", "add", host.namespace)
        self.hosts[name] = host
        _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _ip("link", "set", outside, "master", self.bridge, "up")
        inside = ["netns", "exec", host.namespace, "ip"]
        _ip(*inside, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
        self._write_hosts_files()
        return host

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{h.address} {h.name}" for h in self.hosts.values()]
        for host in self.hosts.values():
            folder = Path("/etc/netns") / host.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def start(self, host: str, argv: list[str], env: dict[str, str], label: str) -> Process:
        """Start ``argv`` on ``host`` under its own host name, output to ``label``.log."""
        target = self.hosts[host]
        log = self.workdir / f"{label}.log"
        command = [
            "ip", "netns", "exec", target.namespace,
            "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', target.name, *argv,
        ]  # fmt: skip
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        process = Process(target, argv, popen, log)
        self.processes.append(process)
        return process

    def stop(self, process: Process, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL after ``timeout``: the process by its pid, then its group."""
        popen = process.popen
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(popen.pid, signal.SIGTERM)
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(popen.pid, signal.SIGKILL)
                popen.wait(5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop every process (newest first), then remove the hosts and the bridge."""
        for process in reversed(self.processes):
            self.stop(process)
        for host in self.hosts.values():
            self._kill_leftovers(host)
            _ip("netns", "del", host.namespace, check=False)
            shutil.rmtree(Path("/etc/netns") / host.namespace, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)

    def _kill_leftovers(self, host: Host) -> None:
        for _ in range(50):
            pids = _ip("netns", "pids", host.namespace, check=False).stdout.split()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.1)
