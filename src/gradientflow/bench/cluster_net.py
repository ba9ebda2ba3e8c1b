"""The emulated cluster's plumbing: rates and token buckets, ``ip``/``tc`` commands, what is left over,
whether this machine can emulate at all, and the little TCP sender/receiver of the throughput probe."""

from __future__ import annotations

import contextlib
import gzip
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "169.254.77"  # third octet fixed: 63 nodes of /30 fit in one /24
BRIDGE_SUBNET = "169.254.78"  # the bridged topology: one /24, node i at .i+1
MAX_NODES = 63
_IFNAME_MAX = 15  # Linux IFNAMSIZ - 1
_TBF_LATENCY = "20ms"  # queue bound; long enough that TCP is not starved by tail drops


def parse_rate(rate: str) -> int | None:
    """``"1gbit"`` -> 1_000_000_000 bits/s; ``"none"`` -> None. Only tc's SI *bit units."""
    text = rate.strip().lower()
    if text == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)", text)
    if not m:
        raise ValueError(f"rate must look like '1gbit', '100mbit' or 'none', got {rate!r}")
    scale = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[m.group(2)]
    bps = int(float(m.group(1)) * scale)
    if bps <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return bps


def kernel_hz() -> int:
    """The kernel's CONFIG_HZ if the config is readable, else 100 (the lowest, so the safest)."""
    sources = [Path("/proc/config.gz"), Path(f"/boot/config-{platform.release()}")]
    for src in sources:
        try:
            raw = gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes()
        except OSError:
            continue
        m = re.search(rb"^CONFIG_HZ=(\d+)$", raw, re.MULTILINE)
        if m:
            return int(m.group(1))
    return 100


def tbf_burst_bytes(rate_bps: int, hz: int | None = None) -> int:
    """Token-bucket size for ``rate_bps``.

    tc-tbf(8): the bucket must hold at least rate/HZ bytes or the rate cannot be reached,
    since tokens are refilled at timer granularity. It must also hold one full GSO packet
    (64 KiB plus headers): veth hands TSO-sized skbs to the qdisc.
    """
    hz = hz or kernel_hz()
    return max(rate_bps // 8 // hz, 65536 + 1514)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short administrative command; raise with its stderr on failure."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    # lines look like "12: name@peer: <FLAGS> ..."
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def leftovers(prefix: str = "gf") -> list[str]:
    """Namespaces and root-namespace links named ``{prefix}-*`` that still exist."""
    if shutil.which("ip") is None:
        return []
    stem = prefix + "-"
    found = [f"netns:{n}" for n in _netns_names() if n.startswith(stem)]
    found += [f"link:{n}" for n in _root_links() if n.startswith(stem)]
    return found


def can_emulate() -> tuple[bool, str]:
    """Whether an :class:`EmulatedCluster` can be built here, with a one-line reason if not."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (install iproute2)"
    probe = f"gfprobe{os.getpid()}"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return False, f"'ip netns add' failed: {made.stderr.strip()}"
        _run(["ip", "-n", probe, "link", "set", "lo", "up"], check=False)
        tbf = _run(
            [
                "tc",
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "1gbit",
                "burst",
                "512kb",
                "latency",
                _TBF_LATENCY,
            ],
            check=False,
        )
        if tbf.returncode != 0:
            return False, f"'tc qdisc add ... tbf' failed: {tbf.stderr.strip()}"
        return True, "ok"
    finally:
        _run(["ip", "netns", "del", probe], check=False)


# Receiver/sender for measure_throughput, run in the namespaces with this interpreter.
_RECEIVER = r"""
import json, socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    if t0 is None:
        t0 = time.perf_counter()  # bytes of this first read are not counted: they precede t0
    else:
        n += k
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}), flush=True)
"""

_SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
left = int(sys.argv[3]); chunk = bytes(1 << 20)
while left > 0:
    c.sendall(chunk[:min(left, len(chunk))]); left -= len(chunk)
c.close()
"""


_QDISCS: dict[str, bool] = {}


def qdisc_available(kind: str) -> bool:
    """Whether this kernel has qdisc ``kind`` (tried as root qdisc of ``lo`` in a throwaway namespace)."""
    if kind not in _QDISCS:
        probe = f"gfq{os.getpid()}"
        try:
            _run(["ip", "netns", "add", probe])
            made = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "handle", "1:", kind], check=False)
            _QDISCS[kind] = made.returncode == 0
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    return _QDISCS[kind]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop ``proc`` and its whole tree: torchrun starts workers in their own sessions, so a
    process-group kill would miss them; every pid of the tree is signalled by id."""
    if proc.poll() is not None:
        return
    tree = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace if sig == signal.SIGTERM else 5)
        if sig == signal.SIGTERM and proc.poll() is not None and not any(_alive(p) for p in tree[1:]):
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_pids(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM each pid, give them ``grace`` seconds, then SIGKILL the ones still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(_alive(p) for p in pids):
            return
