#!/bin/bash
# Issue 72: seeds 1 and 2 of the stdlib runs (2026-12-06), 2 nodes x 2 ranks on loopback, 4,000 steps: torch DDP over
# the 4 ranks (which gave torch HSDP's loss to every digit at seed 0) beside the FSDP door's defaults at H = 100 and the
# top-k 2-bit exchange at H = 30. Usage: run_seeds.sh SEED
cd /work/main
B=benchmarks/fewer_syncs_stdlib
S=$1
.venv/bin/gradientflow bench --quality --workload tiny_transformer --corpus stdlib --nproc 4 --nproc-per-node 2 \
  --steps 4000 --eval-every 200 --bandwidth none --timeout 9000 --seed $S --out $B/2x2_seed$S --recipes \
  "fsdp-none:sync_every=100" "fsdp-none:sync_every=30,outer_compression='topk-2bit'" \
  > $B/2x2_seed$S.log 2>&1
echo done > $B/DONE_seed$S
