"""Launching the bench's ranks: torchrun argv, one torchrun on loopback or one per (emulated) node,
log pumping, waiting with a deadline, and stopping whole process trees.

Nodes of several ranks (``nproc_per_node`` > 1) are launched as a user launches several machines: one
``torchrun --nnodes M --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint ADDR:PORT --rdzv-id ID`` per
node, the endpoint on node 0 (docs/multi-node.md)."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from gradientflow.bench.cluster_net import stop
from gradientflow.bench.link_bytes import LINK_ENV, NODE_ENV
from gradientflow.bench.runner_spec import MARK

__all__ = [
    "NODE_ENV",
    "LINK_ENV",
    "c10d_torchrun_argv",
    "error_from_log",
    "free_port",
    "launch_workers",
    "stop",
    "torchrun_argv",
    "wait_all",
]

_CLUSTER_PORTS = itertools.count(29500)
"""Rendezvous ports on an emulated cluster: the node namespaces are ours alone, and each launch takes
the next port, so none waits for a port its predecessor's store may still hold."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_argv(
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    args: list[str],
    module: str = "gradientflow.bench.runner",
) -> list[str]:
    """``python -m torch.distributed.run`` (torchrun) of ``module``, static rendezvous at the master."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc_per_node),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
        "--max-restarts",
        "0",
        "-m",
        module,
        *args,
    ]


def c10d_torchrun_argv(
    *,
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    rdzv_id: str,
    local_addr: str,
    hosts_store: bool,
    args: list[str],
    module: str = "gradientflow.bench.runner",
) -> list[str]:
    """One node's ``torchrun`` with a c10d rendezvous at ``endpoint`` (``HOST:PORT``), as on a real machine.

    Two flags a user on real machines usually does without: ``--local-addr`` (the node's address on
    the link: every namespace shares this machine's hostname, which resolves to none of them, and
    torchrun would hand that name to the others as the address of rank 0's store) and ``--rdzv-conf
    is_host=...`` (torchrun decides who hosts the rendezvous store by matching the endpoint against the
    machine's hostname and addresses, which the namespaces' addresses are not among)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"is_host={int(hosts_store)}",
        "--local-addr",
        local_addr,
        "--max-restarts",
        "0",
        "-m",
        module,
        *args,
    ]


def _pump(stream: IO[str], log: IO[str], lock: threading.Lock) -> threading.Thread:
    """Copy every line into ``log``; lines carrying :data:`MARK` also go to our stderr."""

    def run() -> None:
        for line in stream:
            with lock:
                log.write(line)
                log.flush()
            if MARK in line:
                sys.stderr.write("  " + line[line.index(MARK) + len(MARK) :])
                sys.stderr.flush()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_all(procs: list[subprocess.Popen], timeout: float, grace_after_failure: float = 20.0) -> str | None:
    """Wait for every process; None if all exited 0, else a one-line reason.  Always stops them all.

    When one fails, the others get ``grace_after_failure`` s before being stopped: a torchrun on
    another node can otherwise wait for its peer until its own (long) timeout.
    """
    deadline = time.monotonic() + timeout
    reason: str | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed and reason is None:
                reason = "; ".join(f"launcher {i} exited with code {c}" for i, c in failed)
                deadline = min(deadline, time.monotonic() + grace_after_failure)
            if all(c is not None for c in codes):
                return reason
            if time.monotonic() > deadline:
                return reason or f"timed out after {timeout:.0f} s"
            time.sleep(0.2)
    finally:
        for p in procs:
            stop(p)


_ERROR_LINE = re.compile(r"(what\(\)|Error:|enforce fail|Received data size|Traceback)")


def error_from_log(path: Path) -> str | None:
    """The most telling error line of a launch log (C++ ``what()``, a Python exception), if any."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    hits = [ln.strip() for ln in lines if _ERROR_LINE.search(ln) and "Traceback" not in ln]
    if not hits:
        return None
    # Gloo prefixes its message with the build path of the check; the message is what helps
    return re.sub(r"\[enforce fail at [^\]]*\]\s*", "", hits[0])[:400]


def launch_workers(
    name: str,
    spec_path: Path,
    out: Path,
    nproc: int,
    cluster: Any,
    timeout: float,
    threads: int,
    module: str = "gradientflow.bench.runner",
    nproc_per_node: int = 1,
) -> tuple[str | None, Path, float]:
    """:func:`_launch_once`, once more where a loopback launch lost its port: :func:`free_port` closes the port it
    found before torchrun binds it, and another program (a parallel test, another bench) can take it in between
    (``EADDRINUSE``); the first try's log is kept as ``launch-<name>.port-taken.log``."""
    reason, log_path, seconds = _launch_once(
        name, spec_path, out, nproc, cluster, timeout, threads, module, nproc_per_node
    )
    if reason is not None and cluster is None and "EADDRINUSE" in log_path.read_text(errors="replace"):
        log_path.replace(log_path.with_suffix(".port-taken.log"))
        reason, log_path, again = _launch_once(
            name, spec_path, out, nproc, cluster, timeout, threads, module, nproc_per_node
        )
        seconds += again
    return reason, log_path, seconds


def _launch_once(
    name: str,
    spec_path: Path,
    out: Path,
    nproc: int,
    cluster: Any,
    timeout: float,
    threads: int,
    module: str = "gradientflow.bench.runner",
    nproc_per_node: int = 1,
) -> tuple[str | None, Path, float]:
    """Run ``python -m module SPEC`` on ``nproc`` ranks, ``nproc_per_node`` per node: one torchrun on
    loopback (``cluster`` None and one rank per node: every rank in it, as always), one torchrun per node
    of an emulated cluster, or (nodes of several ranks, no cluster) one torchrun per node on loopback;
    every line goes to ``out/launch-{name}.log``.

    One rank per node on a cluster keeps its static rendezvous (node i is node rank i); several use
    c10d, as on real machines (:func:`c10d_torchrun_argv`).  Returns (None if every launcher exited 0,
    else a one-line reason; the log's path; seconds).  Everything started is stopped before returning,
    also on timeout or when a rank fails.
    """
    if nproc_per_node < 1 or nproc % nproc_per_node:
        raise ValueError(f"{nproc} ranks cannot be split into nodes of {nproc_per_node}: pass a multiple")
    nodes = nproc // nproc_per_node
    if cluster is not None and cluster.nodes != nodes:
        raise ValueError(
            f"{nproc} ranks at {nproc_per_node} per node need {nodes} nodes; the cluster has {cluster.nodes}"
        )
    # fixed mmap threshold: big tensors are mmapped and returned on free, so RSS deltas per mode are
    # exact; workers switch to malloc's steady state before timing (timing_allocator)
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    log_path = out / f"launch-{name}.log"
    lock = threading.Lock()
    args = [str(spec_path.resolve())]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        procs: list[subprocess.Popen] = []
        pumps = []
        try:
            io: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
            if cluster is None and (nodes == 1 or nproc_per_node == 1):  # loopback: one torchrun, as always
                argv = torchrun_argv(
                    nnodes=1,
                    node_rank=0,
                    nproc_per_node=nproc,
                    master_addr="127.0.0.1",
                    master_port=free_port(),
                    args=args,
                    module=module,
                )
                procs.append(subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True, **io))
            elif nproc_per_node == 1:
                port = next(_CLUSTER_PORTS)
                for i in range(nproc):
                    argv = torchrun_argv(
                        nnodes=nproc,
                        node_rank=i,
                        nproc_per_node=1,
                        master_addr=cluster.master_addr,
                        master_port=port,
                        args=args,
                        module=module,
                    )
                    procs.append(cluster.popen(i, argv, env={**env, **_node_env(cluster, i)}, **io))
            else:
                addrs = cluster.addresses if cluster is not None else ["127.0.0.1"] * nodes
                port = next(_CLUSTER_PORTS) if cluster is not None else free_port()
                rdzv_id = f"gf-{name}-{os.getpid()}-{port}"
                for i in range(nodes):
                    argv = c10d_torchrun_argv(
                        nnodes=nodes,
                        nproc_per_node=nproc_per_node,
                        endpoint=f"{addrs[0]}:{port}",
                        rdzv_id=rdzv_id,
                        local_addr=addrs[i],
                        hosts_store=i == 0,
                        args=args,
                        module=module,
                    )
                    node_env = {**env, **_node_env(cluster, i)}
                    if cluster is not None:
                        procs.append(cluster.popen(i, argv, env=node_env, **io))
                    else:
                        procs.append(
                            subprocess.Popen(argv, env={**os.environ, **node_env}, start_new_session=True, **io)
                        )
            pumps = [_pump(p.stdout, log, lock) for p in procs if p.stdout is not None]  # PIPE: always set
            reason = wait_all(procs, timeout)
        finally:
            for p in procs:
                stop(p)
            for t in pumps:
                t.join(timeout=5)
    return reason, log_path, time.monotonic() - t0


def _node_env(cluster: Any, node: int) -> dict[str, str]:
    """What a node's torchrun passes to its ranks: which node they are on and, on an emulated cluster,
    the link whose counters they read (``GLOO_SOCKET_IFNAME`` is set by ``cluster.popen``)."""
    env = {NODE_ENV: str(node)}
    if cluster is not None:
        env[LINK_ENV] = cluster.ifnames[node]
    return env
