import json, statistics as st, sys
res = {}
for v in ["base", "new"]:
    for r in [1, 2, 3, 4]:
        d = json.load(open(f"benchmarks/regression_check_2026-11-27/{v}-{r}/results.json"))
        rows = {x["name"]: x for x in d["rows"] if not x.get("alone") and not x.get("sweep")}
        for m in ["gf-fp32", "gf-fp16", "gf-fp16-csc-slice"]:
            ref = "ddp-fp16" if m == "gf-fp16" else "ddp"
            res.setdefault((m, v), []).append(rows[m]["median_s"] / rows[ref]["median_s"])
print("| mode (against) | 14512d3 (session start): runs 1-4 | median | final tree: runs 1-4 | median | final / start |")
print("|---|---|---|---|---|---|")
for m, ref in [("gf-fp32", "ddp"), ("gf-fp16", "ddp-fp16"), ("gf-fp16-csc-slice", "ddp")]:
    b, n = res[(m, "base")], res[(m, "new")]
    print(f"| {m} ({ref}) | {', '.join(f'{x:.3f}' for x in b)} | {st.median(b):.3f} | {', '.join(f'{x:.3f}' for x in n)} | {st.median(n):.3f} | {st.median(n)/st.median(b):.3f} |")
