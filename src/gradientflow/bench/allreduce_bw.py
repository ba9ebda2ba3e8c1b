"""Bus bandwidth of gradientflow's ring allreduce vs the backend's native allreduce.

    python -m gradientflow.bench.allreduce_bw --nproc 2 --sizes-mb 1 16 64 256 --repeats 7 --out benchmarks/

1. The launcher starts ``--nproc`` ranks with torchrun (``python -m torch.distributed.run
   --standalone``), each running this module with ``--worker``.
2. Every rank, for every size: allocate a random fp32 tensor, run each algorithm once as a
   warm-up and check the ring's sum against the native one.
3. ``--repeats`` rounds; in each round every algorithm runs once, in an order that rotates
   between rounds, so slow drifts of the machine hit all of them alike.  One timing is
   barrier -> allreduce -> stop, and the slowest rank's time counts (the collective is done
   only when every rank is).
4. Bus bandwidth = bytes * 2(N-1)/N / median time: the bytes each rank's link carries in a
   ring, so figures are comparable across N (the nccl-tests convention).
5. Rank 0 writes the raw times; the launcher prints a table and writes
   ``allreduce_bw_{N}r.json`` and ``.md`` (plus a ``.png`` if matplotlib is there) to ``--out``.

``--pipeline-kb`` and ``--pipeline-depth`` take several values to tune the ring in one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gradientflow.comm.ring import DEFAULT_PIPELINE_BYTES, DEFAULT_PIPELINE_DEPTH, ring_allreduce
from gradientflow.diagnostics.extras import can_plot

logger = logging.getLogger(__name__)
WORKER_MODULE = "gradientflow.bench.allreduce_bw"  # not __name__: that is "__main__" under -m

MB = 1 << 20


def _algorithms(pipeline_kb: list[int] | None, depths: list[int] | None) -> dict[str, dict]:
    """Name -> how to run it.  "native" is the backend's allreduce; "ring" ours, at the library's
    piece size and depth unless several are given (ring@<piece KB>x<depth>)."""
    algos: dict[str, dict] = {"native": {}}
    if not pipeline_kb and not depths:
        algos["ring"] = {}
    for kb in pipeline_kb or [DEFAULT_PIPELINE_BYTES // 1024]:
        for depth in depths or [DEFAULT_PIPELINE_DEPTH]:
            if pipeline_kb or depths:
                algos[f"ring@{kb}KBx{depth}"] = {"pipeline_bytes": kb * 1024, "pipeline_depth": depth}
    return algos


def _run_once(name: str, kw: dict, x: torch.Tensor) -> None:
    if name == "native":
        dist.all_reduce(x)
    else:
        ring_allreduce(x, **kw)


def _worker(args: argparse.Namespace) -> None:
    """Steps 2-3 on one rank; rank 0 writes the raw timings to ``args.result_file``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    algos = _algorithms(args.pipeline_kb, args.pipeline_depth)
    names = list(algos)
    records = []
    for size_mb in args.sizes_mb:
        n = int(size_mb * MB) // 4
        torch.manual_seed(rank)
        x = torch.randn(n)
        # 2. Warm-up (connections, allocator) and a correctness check of the ring.
        ref, mine = x.clone(), x.clone()
        dist.all_reduce(ref)
        for name in names[1:]:
            mine.copy_(x)
            _run_once(name, algos[name], mine)
            rel = ((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            if rel > 1e-5:  # fp32 sums of N <= 8 values in a different order: ~N * 6e-8
                raise RuntimeError(f"{name} disagrees with native at {size_mb} MB: max rel diff {rel:.2e}")
        del ref, mine
        # 3. Interleaved, rotating rounds.  x keeps growing by N per allreduce: harmless for
        # timing, and fp32 does not overflow in a few dozen rounds (N^40 < 3e38 for N <= 8).
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                _run_once(name, algos[name], x)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(dt.item())
                if x.abs().max() > 1e30:
                    x.copy_(torch.randn(n))
        records.append({"size_mb": size_mb, "bytes": n * 4, "times_s": times})
        if rank == 0:
            logger.info("%s MB done", size_mb)
    if rank == 0:
        Path(args.result_file).write_text(json.dumps({"world_size": world, "records": records}))
    dist.destroy_process_group()


def _summarise(raw: dict, algos: dict[str, dict], rate_bps: int | None) -> dict:
    """Step 4: medians and bus bandwidths, ratios to native, fractions of the link's rate."""
    world = raw["world_size"]
    rows = []
    for rec in raw["records"]:
        row = {"size_mb": rec["size_mb"], "bytes": rec["bytes"]}
        for name, ts in rec["times_s"].items():
            med = statistics.median(ts)
            row[name] = {
                "median_s": med,
                "busbw_gbps": rec["bytes"] * 2 * (world - 1) / world / med / 1e9 if world > 1 else None,
                "times_s": ts,
            }
            if rate_bps and world > 1:
                row[name]["line_rate_fraction"] = row[name]["busbw_gbps"] * 8e9 / rate_bps
        for name in algos:
            if name != "native":
                row[name]["vs_native"] = row["native"]["median_s"] / row[name]["median_s"]
        rows.append(row)
    return {"world_size": world, "rows": rows}


def _markdown(summary: dict, algos: dict[str, dict], meta: dict) -> str:
    names = list(algos)
    rate = meta.get("rate_bps")
    head = "| size MB | " + " | ".join(f"{n} busbw GB/s" for n in names)
    head += " | " + " | ".join(f"{n} / native" for n in names[1:])
    head += "".join(f" | {n} / line rate" for n in names) if rate else ""
    head += " |"
    lines = [
        f"Bus bandwidth (GB/s = 1e9 B/s, bytes x 2(N-1)/N / median time), {summary['world_size']} ranks, "
        f"{meta['network']}, fp32, median of {meta['repeats']} interleaved repeats.",
        "",
        f"Command: `{meta['command']}`",
        "",
        head,
        "|" + "---|" * (2 * len(names) + (len(names) if rate else 0)),
    ]
    for row in summary["rows"]:
        cells = [f"{row['size_mb']:g}"] + [f"{row[n]['busbw_gbps']:.3f}" for n in names]
        cells += [f"{row[n]['vs_native']:.2f}x" for n in names[1:]]
        cells += [f"{row[n]['line_rate_fraction']:.1%}" for n in names] if rate else []
        lines.append("| " + " | ".join(cells) + " |")
    if rate:
        lines += [
            "",
            f"Line rate {rate / 1e9:g} Gbit/s; one TCP stream between two nodes measured "
            f"{meta['tcp_goodput_bps'] / 1e9:.3f} Gbit/s just before.",
        ]
    return "\n".join(lines) + "\n"


def _plot(summary: dict, algos: dict[str, dict], path: Path) -> bool:
    if not can_plot():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    sizes = [row["size_mb"] for row in summary["rows"]]
    for name in algos:
        ax.plot(sizes, [row[name]["busbw_gbps"] for row in summary["rows"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor size (MB, fp32)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"allreduce, {summary['world_size']} Gloo ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _run_ranks(args: argparse.Namespace, result_file: Path) -> dict:
    """Step 1: torchrun on loopback, or one torchrun per node of an emulated cluster."""
    from gradientflow.bench.runner import torchrun_argv

    worker = ["--worker", "--result-file", str(result_file)]
    worker += ["--sizes-mb", *map(str, args.sizes_mb), "--repeats", str(args.repeats)]
    worker += ["--pg-timeout", str(args.pg_timeout)]
    if args.pipeline_kb:
        worker += ["--pipeline-kb", *map(str, args.pipeline_kb)]
    if args.pipeline_depth:
        worker += ["--pipeline-depth", *map(str, args.pipeline_depth)]
    env = {"OMP_NUM_THREADS": "1"}
    if not args.bandwidth:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--max-restarts",
            "0",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            "-m",
            WORKER_MODULE,
            *worker,
        ]
        logger.info("launching: %s", " ".join(cmd))
        try:
            codes = [subprocess.run(cmd, env={**os.environ, **env}, timeout=args.timeout).returncode]
        except subprocess.TimeoutExpired:
            raise SystemExit(f"benchmark did not finish in {args.timeout}s (raise --timeout?)") from None
        return {"network": "loopback", "codes": codes}
    from gradientflow.bench.cluster import EmulatedCluster

    # One node (namespace) per rank; the namespaces are ours alone, so a fixed port is free.
    with EmulatedCluster(nodes=args.nproc, rate=args.bandwidth, prefix="gfbw") as cluster:
        goodput = cluster.measure_throughput(0, 1)  # one TCP stream: what the link really gives
        procs = []
        for node in range(args.nproc):
            cmd = torchrun_argv(
                nnodes=args.nproc,
                node_rank=node,
                nproc_per_node=1,
                master_addr=cluster.master_addr,
                master_port=29500,
                args=worker,
                module=WORKER_MODULE,
            )
            procs.append(cluster.popen(node, cmd, env=env))
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"benchmark did not finish in {args.timeout}s") from None  # teardown kills
        return {
            "network": f"emulated {args.bandwidth} per node (netns + veth + tc tbf), {args.nproc} nodes",
            "rate_bps": cluster.rate_bps,
            "tcp_goodput_bps": goodput,
            "codes": codes,
        }


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Steps 1 and 5."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    algos = _algorithms(args.pipeline_kb, args.pipeline_depth)
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "raw.json"
        net = _run_ranks(args, result_file)
        if any(net["codes"]) or not result_file.exists():
            raise SystemExit(f"benchmark ranks failed (exit codes {net['codes']}); see their output above")
        raw = json.loads(result_file.read_text())
    summary = _summarise(raw, algos, net.get("rate_bps"))
    meta = {
        "command": "python -m gradientflow.bench.allreduce_bw " + " ".join(argv),
        "network": net["network"],
        "rate_bps": net.get("rate_bps"),
        "tcp_goodput_bps": net.get("tcp_goodput_bps"),
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "default_pipeline_bytes": DEFAULT_PIPELINE_BYTES,
        "default_pipeline_depth": DEFAULT_PIPELINE_DEPTH,
    }
    net_tag = f"_{args.bandwidth}" if args.bandwidth else ""
    stem = out / f"allreduce_bw_{args.nproc}r{net_tag}{args.suffix}"
    Path(f"{stem}.json").write_text(json.dumps({"meta": meta, **summary}, indent=1))
    md = _markdown(summary, algos, meta)
    Path(f"{stem}.md").write_text(md)
    plotted = _plot(summary, algos, Path(f"{stem}.png"))
    print(md)
    print(f"wrote {stem}.json/.md" + ("/.png" if plotted else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--pipeline-kb", type=int, nargs="*", help="ring piece sizes to compare (default: the library's)")
    p.add_argument("--pipeline-depth", type=int, nargs="*", help="ring pieces in flight to compare")
    p.add_argument("--out", default="benchmarks/")
    p.add_argument("--suffix", default="", help="appended to output file names")
    p.add_argument(
        "--bandwidth",
        help="run each rank in its own network namespace, links shaped to this rate "
        "(e.g. 1gbit; needs root, see bench/cluster.py)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    p.add_argument("--pg-timeout", type=float, default=120, help="seconds for any one collective")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.worker:
        _worker(args)
        return 0
    return _launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
