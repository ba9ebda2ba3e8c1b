"""α and B of this machine's emulated cluster, measured (not assumed) for the model's validation.

    python -m gradientflow.sim.measure --nproc 2 --bandwidth 1gbit --out benchmarks/sim_validation

1. Build an emulated cluster (bench/cluster.py: one network namespace per rank, links shaped
   with tc, link-local addresses only) under our own prefix, so a concurrent bench elsewhere
   keeps its namespaces.
2. Run the allreduce bandwidth bench's own worker (bench/allreduce_bw.py) on every node: Gloo's
   native allreduce (what ``gradientflow bench`` uses by default) and the project's ring, fp32,
   at a few sizes from 4 KB to 32 MB, slowest rank's time, median of ``--repeats``.
   The first size is measured twice and its first record dropped: the first collectives of a
   fresh process group pay one-off costs (seen here: 3.2 ms for 4 KB, then 0.9 ms for 64 KB).
3. Two points, no fit to any target: B from the slope between the smallest and the largest
   message, α = t(smallest) - x(smallest)/B, x = 2(N-1)/N · bytes (the ring's bytes per link).
4. Write ``alpha_beta.json`` with the raw medians, α, B, and the formula's error at every size.

``--loopback``: the same measurement between ``--nproc`` ranks of one node, on this machine's
loopback (no namespace, no shaping, no root): α and B inside a node of the bench's emulated cluster,
whose ranks of one node talk over their namespace's loopback (docs/multi-node.md).

    python -m gradientflow.sim.measure --loopback --nproc 2 --out benchmarks/sim_validation/loopback
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1 << 20
SIZES_MB = (4 / 1024, 64 / 1024, 1.0, 8.0, 32.0)


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(α seconds, B bytes/s) through the smallest and the largest (x bytes, t seconds) point."""
    (x0, t0), (x1, t1) = min(points), max(points)
    if x1 <= x0 or t1 <= t0:
        raise ValueError(f"cannot fit α and B: need a larger message that takes longer, got {points}")
    bw = (x1 - x0) / (t1 - t0)
    return max(t0 - x0 / bw, 0.0), bw


def _run(args: argparse.Namespace, result: Path) -> dict:
    """Steps 1-2."""
    from gradientflow.bench.allreduce_bw import WORKER_MODULE
    from gradientflow.bench.cluster import EmulatedCluster
    from gradientflow.bench.runner import torchrun_argv

    sizes = [args.sizes_mb[0], *args.sizes_mb]  # the first record is a warm-up, dropped in main()
    worker = [
        "--worker",
        "--result-file",
        str(result),
        "--sizes-mb",
        *map(str, sizes),
        "--repeats",
        str(args.repeats),
        "--pg-timeout",
        "120",
    ]
    if args.loopback:
        import socket  # noqa: PLC0415

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        argv = torchrun_argv(
            nnodes=1,
            node_rank=0,
            nproc_per_node=args.nproc,
            master_addr="127.0.0.1",
            master_port=port,
            args=worker,
            module=WORKER_MODULE,
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        try:
            code = subprocess.run(argv, env=env, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            raise SystemExit(f"measurement did not finish in {args.timeout}s") from None
        return {"rate_bps": None, "tcp_goodput_bps": None, "codes": [code]}
    with EmulatedCluster(nodes=args.nproc, rate=args.bandwidth, prefix=args.prefix) as cluster:
        goodput = cluster.measure_throughput(0, 1)
        procs = [
            cluster.popen(
                node,
                torchrun_argv(
                    nnodes=args.nproc,
                    node_rank=node,
                    nproc_per_node=1,
                    master_addr=cluster.master_addr,
                    master_port=29500,
                    args=worker,
                    module=WORKER_MODULE,
                ),
                env={"OMP_NUM_THREADS": "1"},
            )
            for node in range(args.nproc)
        ]
        deadline = time.monotonic() + args.timeout
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            raise SystemExit(f"measurement did not finish in {args.timeout}s") from None  # teardown kills
        return {"rate_bps": cluster.rate_bps, "tcp_goodput_bps": goodput, "codes": codes}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=list(SIZES_MB))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--loopback",
        action="store_true",
        help="measure between --nproc ranks of one node on this machine's loopback (no shaping, no root)",
    )
    p.add_argument("--prefix", default="gfsim", help="namespace prefix, distinct from the bench's")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="benchmarks/sim_validation")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "raw.json"
        net = _run(args, result)
        if any(net["codes"]) or not result.exists():
            raise SystemExit(f"ranks failed (exit codes {net['codes']})")
        raw = json.loads(result.read_text())
    raw["records"] = raw["records"][1:]
    n = raw["world_size"]
    out: dict = {
        "command": "python -m gradientflow.sim.measure " + " ".join(argv),
        "world_size": n,
        "network": "loopback, one node"
        if args.loopback
        else f"emulated {args.bandwidth} per node (netns + veth + tc tbf)",
        **net,
        "loadavg_1min": os.getloadavg()[0],
        "fits": {},
    }
    for algo in raw["records"][0]["times_s"]:
        pts = [(2 * (n - 1) / n * rec["bytes"], statistics.median(rec["times_s"][algo])) for rec in raw["records"]]
        alpha, bw = fit_alpha_beta(pts)
        out["fits"][algo] = {
            "alpha_s": alpha,
            "bandwidth_Bps": bw,
            "bandwidth_gbit": bw * 8 / 1e9,
            "points": [
                {"bytes": rec["bytes"], "median_s": t, "model_s": alpha + x / bw, "error": (alpha + x / bw - t) / t}
                for rec, (x, t) in zip(raw["records"], pts)
            ],
        }
        tcp = net["tcp_goodput_bps"]
        print(
            f"{algo}: α = {alpha * 1e6:.0f} µs, B = {bw * 8 / 1e9:.3f} Gbit/s"
            + (f" (one TCP stream: {tcp / 1e9:.3f} Gbit/s)" if tcp else "")
        )
        for pt in out["fits"][algo]["points"]:
            print(
                f"  {pt['bytes'] / MB:8.3f} MB  measured {pt['median_s'] * 1e3:8.2f} ms  "
                f"model {pt['model_s'] * 1e3:8.2f} ms  ({pt['error']:+.1%})"
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "alpha_beta.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
