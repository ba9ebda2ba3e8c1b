"""``gradientflow trace-summary FILE...``: where the time went in a trace written with ``trace_path=``.

Reads the Chrome-trace JSON of :mod:`gradientflow.diagnostics.trace` and prints, per file (= per rank):

1. the engine track per category, in ms per step: forward, backward (compute plus handing
   buckets over), the final wait (communication not hidden behind backward, plus CSC's
   select/pack/write-back), CSC phases, checks;
2. collectives by kind (bucket, scores, chunks): count, MB, time from launch to completion
   (overlapping backward, so these do not add up to the step);
3. blocking waits on the engine thread by what was waited on.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any


def load_events(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The complete ("X") events of a trace file and its ``otherData``; ValueError if not a trace."""
    with open(path) as f:
        doc = json.load(f)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents list)")
    meta = doc.get("otherData", {}) if isinstance(doc, dict) else {}
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"], meta


def kind_of(name: str) -> str:
    """ "wait bucket 3" -> "bucket", "scores of pool 0 chunks 0-9" -> "scores", "x (y)" -> "x"."""
    name = re.sub(r"^wait ", "", name)
    name = re.sub(r"\s*\(.*\)$", "", name)
    name = re.sub(r" of pool .*$", "", name)
    return re.sub(r"\s+\d+$", "", name)


def summarize(path: str) -> str:
    """The report for one trace file, as text."""
    events, meta = load_events(path)
    if not events:
        return f"{path}: no events (were the traced steps reached?)"
    steps = sorted({e.get("args", {}).get("step") for e in events} - {None})
    n = max(1, len(steps))
    engine = [e for e in events if e.get("tid") == 0]
    per_step_span: dict[int, list[float]] = {}
    for e in engine:
        s = e.get("args", {}).get("step")
        lo, hi = per_step_span.get(s, [e["ts"], e["ts"] + e["dur"]])
        per_step_span[s] = [min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])]
    step_ms = sum(hi - lo for lo, hi in per_step_span.values()) / 1e3

    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[tuple[str, str], float] = defaultdict(float)
    for e in engine:
        by_cat[e["cat"]] += e["dur"] / 1e3
        if e["cat"] in ("csc", "check"):
            by_name[(e["cat"], e["name"])] += e["dur"] / 1e3

    lines = [
        f"{path}: rank {meta.get('rank', '?')} of {meta.get('world_size', '?')}, {len(steps)} step(s) {steps}",
        f"  {'engine track':<44}{'total ms':>10}{'ms/step':>10}{'% of step':>11}",
    ]

    def row(label: str, ms: float, indent: int = 2) -> None:
        share = f"{100 * ms / step_ms:.1f}" if step_ms > 0 else "-"
        lines.append(f"{' ' * indent}{label:<{46 - indent}}{ms:>10.2f}{ms / n:>10.2f}{share:>11}")

    row("step (first to last event of the step)", step_ms)
    labels = [
        ("forward", "forward"),
        ("backward", "backward (compute + bucket hand-over)"),
        ("launch", "bucket hand-over (cast / CSC accumulate)"),
        ("final", "final wait (exposed comm + CSC finish)"),
    ]
    for cat, label in labels:
        if cat in by_cat:
            row(label, by_cat[cat], 4 if cat == "launch" else 2)
    for (cat, name), ms in sorted(by_name.items()):
        if cat == "csc":
            row(name, ms, 4)
    for (cat, name), ms in sorted(by_name.items()):
        if cat == "check":  # the step check runs inside backward, the finite check after it
            row(f"{name} (check_{'consistency' if name == 'step check' else 'finite'})", ms)

    colls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("cat") == "collective":
            c = colls[kind_of(e["args"].get("kind", e["name"]))]
            c[0] += 1
            c[1] += e["args"].get("bytes", 0) / 2**20
            c[2] += e["dur"] / 1e3
    if colls:
        lines.append(f"  {'collectives, launch to completion':<34}{'count':>7}{'MB':>9}{'total ms':>10}{'mean ms':>10}")
        for kind, (count, mb, ms) in sorted(colls.items()):
            lines.append(f"    {kind:<32}{count:>7}{mb:>9.3f}{ms:>10.2f}{ms / count:>10.2f}")
    waits: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in engine:
        if e["cat"] == "wait":
            w = waits[kind_of(e["name"])]
            w[0] += 1
            w[1] += e["dur"] / 1e3
    if waits:
        lines.append(f"  {'blocking waits (engine thread)':<34}{'count':>7}{'':>9}{'total ms':>10}{'ms/step':>10}")
        for kind, (count, ms) in sorted(waits.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"    {kind:<32}{count:>7}{'':>9}{ms:>10.2f}{ms / n:>10.2f}")
    return "\n".join(lines)
