"""``gradientflow bench --links ...``: the whole bench on every link profile, one after the other.

Per profile (:mod:`gradientflow.bench.links`): build the emulated cluster, measure the link
(:func:`~gradientflow.bench.links_probe.measure_link`: bulk throughput, one small collective), run
every launch of the bench on it (:func:`~gradientflow.bench.runner.run_launches`), tear the cluster
down, write the profile's own ``results.json``/``table.md``/``bench.png`` under ``OUT/<profile>/``.
Then the matrix (:mod:`gradientflow.bench.links_report`): ``matrix.json``, ``matrix.md``, ``matrix.png``.
A profile whose cluster or main launch fails is recorded as failed; the others still run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from gradientflow.bench import links_report, report
from gradientflow.bench.cluster import EmulatedCluster, can_emulate
from gradientflow.bench.links import LinkProfile, parse_links
from gradientflow.bench.links_probe import measure_link
from gradientflow.bench.runner import run_launches

logger = logging.getLogger(__name__)


def profile_options(opts: Any, profile: LinkProfile) -> Any:
    """The bench's options on ``profile``: its node count, model and batch where it sets them."""
    return dataclasses.replace(
        opts,
        nproc=profile.nodes or opts.nproc,
        workload=profile.workload or opts.workload,
        input_shape=None if profile.workload else opts.input_shape,
        batch_size=profile.batch_size or opts.batch_size,
        bandwidth=profile.rate,
        out=str(Path(opts.out) / profile.name),
        links=[],
    )


def run_profile(opts: Any, profile: LinkProfile) -> dict[str, Any]:
    """One profile: link probe and every bench launch inside one cluster; the summary with ``link`` added."""
    p_opts = profile_options(opts, profile)
    out = Path(p_opts.out)
    with EmulatedCluster(nodes=p_opts.nproc, prefix=opts.prefix, profile=profile) as cluster:
        link = measure_link(cluster, p_opts.nproc, out)
        logger.info(
            "links %s: bulk %.3f Gbit/s (%.3f while computing), one small collective %.2f ms",
            profile.name,
            8 * link["bulk_Bps"] / 1e9,
            8 * link["busy_bulk_Bps"] / 1e9,
            1e3 * link["small_s"],
        )
        launches = run_launches(p_opts, cluster)
        described = cluster.describe()
    summary = report.summarize(launches, p_opts, emulated=True)
    summary["network"] = f"emulated: {described}"
    summary["profile"] = dataclasses.asdict(profile)
    summary["link"] = link
    summary["efficiency"] = links_report.efficiency_rows(summary, link)
    report.write_all(summary, out)
    return summary


def run_links(opts: Any) -> dict[str, Any]:
    """Every profile in ``opts.links`` (names, or ``["all"]``); writes and returns the matrix."""
    profiles = parse_links(",".join(opts.links))
    ok, why = can_emulate()
    if not ok:
        raise RuntimeError(f"--links needs an emulated cluster, and this machine cannot build one: {why}")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]  # the conditions: on a shared machine every figure moves with them
    results: list[dict[str, Any]] = []
    for profile in profiles:
        logger.info("links: profile %s (%s)", profile.name, profile.describe())
        try:
            results.append(run_profile(opts, profile))
        except RuntimeError as exc:  # this profile's cluster or main launch; the next profile still runs
            logger.warning("links: profile %s failed: %s", profile.name, exc)
            results.append({"profile": dataclasses.asdict(profile), "error": str(exc)})
    command = " ".join(["gradientflow", *sys.argv[1:]]) if sys.argv[0].endswith(("gradientflow", "cli.py")) else None
    matrix = links_report.matrix(
        results,
        command=command,
        started=started.strftime("%Y-%m-%d %H:%M UTC"),
        finished=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        load=(load_before, os.getloadavg()[0]),
        cpus=os.cpu_count() or 0,
    )
    (out / "matrix.json").write_text(json.dumps(matrix, indent=1, default=str))
    table = links_report.markdown(matrix)
    (out / "matrix.md").write_text(table)
    links_report.plot(matrix, out / "matrix.png")
    print(table)
    return matrix


def probe_all(links: str = "all", out: str = "benchmarks/links/probe", prefix: str = "gfp") -> list[dict[str, Any]]:
    """Only the link probes of ``links`` (no bench): one ``link.json`` per profile under ``out``, and
    ``probe.md``, a table of bulk throughput and the small collective's cost, idle and behind a bulk one."""
    ok, why = can_emulate()
    if not ok:
        raise RuntimeError(f"the link probes need an emulated cluster, and this machine cannot build one: {why}")
    rows = []
    for profile in parse_links(links):
        nodes = profile.nodes or 2
        with EmulatedCluster(nodes=nodes, prefix=prefix, profile=profile) as cluster:
            link = measure_link(cluster, nodes, Path(out) / profile.name)
            rows.append({"profile": profile.name, "network": cluster.describe(), "nodes": nodes, **link})
    lines = [
        f"Link probes, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        "| profile | network | ranks | bulk Gbit/s (32 MB allreduce) | the same while computing "
        "| small collective ms | behind a bulk one ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['profile']} | {r['network']} | {r['nodes']} | {8 * r['bulk_Bps'] / 1e9:.3f} "
        f"| {8 * r['busy_bulk_Bps'] / 1e9:.3f} | {1e3 * r['small_s']:.2f} | {1e3 * r['loaded_small_s']:.1f} |"
        for r in rows
    ]
    (Path(out) / "probe.md").write_text("\n".join(lines) + "\n")
    (Path(out) / "probe.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return rows
