"""The table of ``experiments/ab/run.sh``'s output: each gradientflow mode's median step over torch DDP's of the
same launch, per run and the median per tree, the modes by the recipe table's names (an older tree's
``gf-fp16-csc-slice`` is ``gf-topk-fp16``).  ``python3 experiments/ab/summary.py OUT``."""

import json
import statistics
import sys
from pathlib import Path

from gradientflow.bench.mode_names import canonical_name

out = Path(sys.argv[1])
revs = dict(line.split() for line in (out / "revs.txt").read_text().splitlines())
ratios: dict[tuple[str, str], list[float]] = {}
runs = sorted(out.glob("*-[0-9]*/results.json"), key=lambda p: int(p.parent.name.rsplit("-", 1)[1]))
for path in runs:
    tree = path.parent.name.rsplit("-", 1)[0]
    rows = {
        canonical_name(r["name"]): r
        for r in json.loads(path.read_text())["rows"]
        if not r.get("alone") and not r.get("sweep")
    }
    for name, row in rows.items():
        if name.startswith("gf"):
            ratios.setdefault((name, tree), []).append(row["median_s"] / rows["ddp"]["median_s"])
modes = sorted({m for m, _ in ratios})
print(f"| mode / DDP | {revs['base']}: runs in order | median | {revs['new']}: runs in order | median | new / base |")
print("|---|---|---|---|---|---|")
for m in modes:
    b, n = ratios[(m, "base")], ratios[(m, "new")]
    mb, mn = statistics.median(b), statistics.median(n)
    runs_b, runs_n = ", ".join(f"{x:.3f}" for x in b), ", ".join(f"{x:.3f}" for x in n)
    print(f"| {m} | {runs_b} | {mb:.3f} | {runs_n} | {mn:.3f} | {mn / mb:.3f} |")
