"""An emulated cluster on one machine: network namespaces joined through a shaped star.

Every node gets its own network namespace ``{prefix}-n{i}``; a switch namespace
``{prefix}-sw`` sits in the middle with one veth pair per node, like a switch with one port
per node. Both ends of every pair are shaped with ``tc tbf`` so each node has ``rate`` up and
``rate`` down, the situation of a GPU cluster where the NIC, not the host, is the bottleneck.

Addresses come only from 169.254.0.0/16 (link-local): node i's link is the /30
``169.254.77.4i`` with ``.4i+1`` on the switch side and ``.4i+2`` on the node side. Nothing is
done in the root namespace: veths are created directly inside their namespaces, forwarding is
enabled only inside the switch namespace, and deleting the namespaces removes everything.

Requires root, ``ip`` and ``tc``; :func:`can_emulate` says whether that holds.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

from gradientflow.bench.cluster_net import (
    _IFNAME_MAX,
    _RECEIVER,
    _SENDER,
    BRIDGE_SUBNET,
    MAX_NODES,
    SUBNET,
    _netns_names,
    _run,
    can_emulate,
    kernel_hz,
    kill_pids,
    leftovers,
    parse_rate,
    qdisc_available,
    stop,
    tbf_burst_bytes,
)
from gradientflow.bench.links import LinkProfile

__all__ = [
    "MAX_NODES",
    "SUBNET",
    "EmulatedCluster",
    "can_emulate",
    "kernel_hz",
    "leftovers",
    "parse_rate",
    "tbf_burst_bytes",
]

logger = logging.getLogger(__name__)


class EmulatedCluster:
    """Context manager: ``nodes`` namespaces behind a switch, each port shaped to ``rate``.

    >>> with EmulatedCluster(nodes=2, rate="1gbit", prefix="gf") as c:   # doctest: +SKIP
    ...     p = c.popen(1, [sys.executable, "worker.py"], env={"MASTER_ADDR": c.master_addr})

    Attributes: ``namespaces`` (one per node), ``switch`` (the switch namespace),
    ``addresses`` (node i is reachable from every other node at ``addresses[i]``),
    ``ifnames`` (node-side interface in each namespace, for ``GLOO_SOCKET_IFNAME``),
    ``master_addr`` (``addresses[0]``), ``rate_bps`` (None when unshaped).

    ``profile`` (a :class:`~gradientflow.bench.links.LinkProfile`) sets the shaper, its bucket and
    queue, and the topology: ``"star"`` routes through the switch namespace (a /30 per node),
    ``"bridge"`` joins every node to one Linux bridge ``{prefix}-br`` there (one /24,
    ``169.254.78.i+1``).  Without one, every port gets tbf at ``rate`` (None-shaped for ``"none"``).

    Teardown (normal exit, exception, SIGINT, SIGTERM, atexit) kills the processes started
    with :meth:`popen` that are still running and deletes every namespace, which removes the
    veths in it. Stale ``{prefix}-*`` namespaces from a crashed run are deleted on entry; ones with
    live processes in them (another run with the same prefix) are refused with a ``RuntimeError``:
    concurrent runs must pick different prefixes.
    """

    def __init__(
        self, nodes: int = 2, rate: str = "1gbit", prefix: str = "gf", profile: LinkProfile | None = None
    ) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be in 1..{MAX_NODES}, got {nodes}")
        if not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9]*", prefix):
            raise ValueError(f"prefix must be alphanumeric and start with a letter, got {prefix!r}")
        longest = f"{prefix}-s{nodes - 1}"
        if len(longest) > _IFNAME_MAX:
            raise ValueError(f"prefix {prefix!r} too long: interface {longest!r} exceeds 15 chars")
        self.nodes = nodes
        self.rate_bps = parse_rate(rate) if profile is None else profile.rate_bps
        # without a profile: tbf at ``rate`` with the smallest bucket that reaches it, on a routed star
        self.profile = profile or LinkProfile("custom", rate if self.rate_bps else "1gbit")
        self.rate = self.profile.rate if self.rate_bps else "none"
        self.bridge = f"{prefix}-br"
        self.leaf = self.profile.leaf  # HTB's leaf qdisc, checked against the kernel in start()
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.namespaces = [f"{prefix}-n{i}" for i in range(nodes)]
        self.ifnames = [f"{prefix}-e{i}" for i in range(nodes)]
        self.switch_ifnames = [f"{prefix}-s{i}" for i in range(nodes)]
        if self.profile.topology == "bridge":  # one /24, node i at .i+1
            self.addresses = [f"{BRIDGE_SUBNET}.{i + 1}" for i in range(nodes)]
        else:
            self.addresses = [f"{SUBNET}.{4 * i + 2}" for i in range(nodes)]
        self.gateways = [f"{SUBNET}.{4 * i + 1}" for i in range(nodes)]
        self.master_addr = self.addresses[0]
        self._children: list[subprocess.Popen] = []
        self._prev_handlers: dict[int, Any] = {}
        self._active = False
        self._lock = threading.RLock()  # close() may re-enter from a signal handler

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the namespaces, links, routes and shaping. Cleans up after itself on failure."""
        if self._active:
            raise RuntimeError(f"emulated cluster {self.prefix} is already running")
        ok, why = can_emulate()
        if not ok:
            raise RuntimeError(f"cannot emulate a cluster: {why}")
        self._delete_stale()
        if self.profile.shaper == "htb" and not qdisc_available(self.leaf):
            logger.warning("this kernel has no %s qdisc: HTB's leaf is pfifo instead", self.leaf)
            self.leaf = "pfifo"
        self._active = True
        self._install_handlers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        logger.info(
            "emulated cluster %s: %d nodes at %s, addresses %s", self.prefix, self.nodes, self.rate, self.addresses
        )

    def close(self) -> None:
        """Tear everything down. Idempotent; safe from a signal handler or atexit."""
        with self._lock:
            if not self._active:
                return
            self._active = False
        # A second Ctrl-C during teardown must not leave half a cluster behind: hold SIGINT and
        # SIGTERM until the namespaces are gone (well under a second), then deliver them.
        deferred: list[int] = []
        if self._prev_handlers and threading.current_thread() is threading.main_thread():
            for sig in self._prev_handlers:
                signal.signal(sig, lambda signum, frame: deferred.append(signum))
        try:
            self._kill_children()
            for ns in [*self.namespaces, self.switch]:
                if ns in _netns_names():
                    # a namespace outlives its name while a process is inside it; say so
                    # a namespace outlives its name while a process is inside it: only our own
                    # processes can be in our namespaces (orphans of a killed launcher); end them
                    pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
                    if pids:
                        logger.warning("stopping processes %s still running in %s", pids, ns)
                        kill_pids(pids)
                    _run(["ip", "netns", "del", ns], check=False)
        finally:
            self._restore_handlers()
            atexit.unregister(self.close)
            for sig in deferred:
                os.kill(os.getpid(), sig)  # now handled by the original handlers
        left = leftovers(self.prefix)
        if left:
            logger.warning("emulated cluster %s left behind: %s", self.prefix, left)

    def _delete_stale(self) -> None:
        stale = leftovers(self.prefix)
        # A namespace with processes in it is another run's, alive, that uses the same prefix: deleting it
        # would cut that run's links mid-step (two benches at once did exactly that).  Refuse instead.
        busy = {}
        for item in stale:
            kind, name = item.split(":", 1)
            if kind == "netns":
                pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
                if pids:
                    busy[name] = pids
        if busy:
            raise RuntimeError(
                f"network namespaces {sorted(busy)} are in use by running processes (pids "
                f"{sorted({p for v in busy.values() for p in v})}): another emulated cluster with prefix "
                f"{self.prefix!r} is running. Pass another --netns-prefix, or wait for it to end."
            )
        if stale:
            logger.warning("deleting stale %s from an earlier run", stale)
        for item in stale:
            kind, name = item.split(":", 1)
            if kind == "netns":
                _run(["ip", "netns", "del", name], check=False)
            else:
                _run(["ip", "link", "del", name], check=False)

    def _build(self) -> None:
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        bridge = self.profile.topology == "bridge"
        if bridge:  # one L2 segment: the switch namespace only forwards frames, no routing
            _run(["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", self.bridge, "up"])
        else:  # forwarding only inside the switch namespace: the root namespace is never touched
            _run(["ip", "netns", "exec", sw, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        for i, ns in enumerate(self.namespaces):
            node_if, sw_if = self.ifnames[i], self.switch_ifnames[i]
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            for setting in self.profile.node_sysctls():  # the namespace's own: the host's stay as they are
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", setting])
            # created directly in both namespaces, so the pair never appears in the root one
            _run(["ip", "link", "add", sw_if, "netns", sw, "type", "veth", "peer", "name", node_if, "netns", ns])
            if bridge:
                _run(["ip", "-n", sw, "link", "set", sw_if, "master", self.bridge])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", node_if])
            else:
                _run(["ip", "-n", sw, "addr", "add", f"{self.gateways[i]}/30", "dev", sw_if])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/30", "dev", node_if])
            if self.profile.mtu is not None:  # both ends: a frame is as large as the smaller one allows
                _run(["ip", "-n", sw, "link", "set", sw_if, "mtu", str(self.profile.mtu)])
                _run(["ip", "-n", ns, "link", "set", node_if, "mtu", str(self.profile.mtu)])
            _run(["ip", "-n", sw, "link", "set", sw_if, "up"])
            _run(["ip", "-n", ns, "link", "set", node_if, "up"])
            if not bridge:
                _run(["ip", "-n", ns, "route", "add", "default", "via", self.gateways[i]])
            if self.rate_bps is not None:
                # node side shapes the node's upload, switch side its download
                self._shape(ns, node_if)
                self._shape(sw, sw_if)

    def _shape(self, ns: str, dev: str) -> None:
        for argv in self.profile.shape_commands(ns, dev, self.leaf):
            _run(argv)

    def describe(self) -> str:
        """The network in one line: the profile's shaper (with the HTB leaf actually used) and topology."""
        return self.profile.describe(self.leaf) if self.rate_bps else "unshaped"

    # ---- signals ---------------------------------------------------------------------
    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works in the main thread; atexit still covers us
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_handlers = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        logger.warning("signal %d: tearing down emulated cluster %s", signum, self.prefix)
        self.close()
        # then behave as if we had never been here: KeyboardInterrupt for SIGINT, death for SIGTERM
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ---- processes -------------------------------------------------------------------
    def popen(self, node: int, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace.

        ``env`` is added to a copy of this process's environment; ``GLOO_SOCKET_IFNAME`` is
        set to the node's interface unless ``env`` sets it. The child runs in its own session
        (so a terminal's Ctrl-C reaches only us, and teardown can stop its whole group).
        """
        if not self._active:
            raise RuntimeError("cluster is not running: use it inside 'with EmulatedCluster(...)'")
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be in 0..{self.nodes - 1}, got {node}")
        full_env = dict(os.environ)
        full_env["GLOO_SOCKET_IFNAME"] = self.ifnames[node]
        full_env.update(env or {})
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], env=full_env, **kw)
        self._children.append(proc)
        return proc

    def _kill_children(self) -> None:
        # the whole tree of each child: torchrun starts its workers in sessions of their own
        for proc in self._children:
            stop(proc, grace=3.0)
        self._children = []

    # ---- measurement -----------------------------------------------------------------
    def link_bytes(self, node: int) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) the kernel has counted on node ``node``'s link interface so far.

        Read inside the node's namespace (``ip netns exec`` mounts its sysfs); the same counters the
        bench's workers read (:mod:`gradientflow.bench.link_bytes`)."""
        stats = f"/sys/class/net/{self.ifnames[node]}/statistics"
        out = _run(["ip", "netns", "exec", self.namespaces[node], "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"])
        tx, rx = (int(v) for v in out.stdout.split())
        return tx, rx

    def measure_throughput(self, src: int, dst: int, nbytes: int = 20_000_000, timeout: float = 60.0) -> float:
        """Goodput in bits/s of one TCP stream of ``nbytes`` from node ``src`` to node ``dst``.

        Timed at the receiver from the first to the last byte, so connection setup and
        process start-up are excluded.
        """
        recv = self.popen(
            dst, [sys.executable, "-c", _RECEIVER, self.addresses[dst]], stdout=subprocess.PIPE, text=True
        )
        procs = [recv]
        try:
            assert recv.stdout is not None
            port = recv.stdout.readline().strip()
            if not port:
                raise RuntimeError("throughput receiver did not start")
            procs.append(
                self.popen(
                    src,
                    [sys.executable, "-c", _SENDER, self.addresses[dst], port, str(nbytes)],
                    stdout=subprocess.DEVNULL,
                )
            )
            procs[1].wait(timeout=timeout)
            out, _ = recv.communicate(timeout=timeout)
        finally:
            for p in procs:  # only left running on error or timeout
                if p.poll() is None:
                    p.kill()
                    p.wait()
        result = json.loads(out.strip().splitlines()[-1])
        if result["bytes"] < nbytes // 2:
            raise RuntimeError(f"throughput test received only {result['bytes']} of {nbytes} bytes")
        return result["bytes"] * 8 / result["seconds"]
