#!/bin/bash
# Issue 72: fewer syncs on the stdlib corpus (2026-12-06), the FSDP door beside torch's HSDP, 2 nodes x 2 ranks on
# loopback, 4,000 steps, validated every 200, seed 0: the defaults (averaging through 3 bits) at H = 100 and H = 30,
# and averaging through the top-k 2-bit exchange at H = 30.
cd /work/main
B=benchmarks/fewer_syncs_stdlib
.venv/bin/gradientflow bench --quality --workload tiny_transformer --corpus stdlib --nproc 4 --nproc-per-node 2 \
  --steps 4000 --eval-every 200 --bandwidth none --timeout 9000 --seed 0 --out $B/2x2_seed0 --recipes hsdp \
  "fsdp-none:sync_every=100" "fsdp-none:sync_every=30" "fsdp-none:sync_every=30,outer_compression='topk-2bit'" \
  > $B/2x2_seed0.log 2>&1
echo done > $B/DONE
