"""The table of ``experiments/ab/regression_check_2026-11-27.sh``'s runs (docs/results/benchmarks.md): each mode's
median step over torch DDP's (the fp16 wire over DDP + fp16 hook), per run and tree, the modes by the recipe
table's names (the runs' gf-fp32 is gf-none, gf-fp16-csc-slice gf-topk-fp16).  From the repository root."""

import json
import statistics as st

from gradientflow.bench.mode_names import canonical_name

res = {}
for v in ["base", "new"]:
    for r in [1, 2, 3, 4]:
        d = json.load(open(f"benchmarks/regression_check_2026-11-27/{v}-{r}/results.json"))
        rows = {canonical_name(x["name"]): x for x in d["rows"] if not x.get("alone") and not x.get("sweep")}
        for m in ["gf-none", "gf-fp16", "gf-topk-fp16"]:
            ref = "ddp-fp16" if m == "gf-fp16" else "ddp"
            res.setdefault((m, v), []).append(rows[m]["median_s"] / rows[ref]["median_s"])
print("| mode (against) | 14512d3 (session start): runs 1-4 | median | final tree: runs 1-4 | median | final / start |")
print("|---|---|---|---|---|---|")
for m, ref in [("gf-none", "ddp"), ("gf-fp16", "ddp-fp16"), ("gf-topk-fp16", "ddp")]:
    b, n = res[(m, "base")], res[(m, "new")]
    runs_b, runs_n = ", ".join(f"{x:.3f}" for x in b), ", ".join(f"{x:.3f}" for x in n)
    mb, mn = st.median(b), st.median(n)
    print(f"| {m} ({ref}) | {runs_b} | {mb:.3f} | {runs_n} | {mn:.3f} | {mn / mb:.3f} |")
