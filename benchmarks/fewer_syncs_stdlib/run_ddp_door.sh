#!/bin/bash
# Issue 72: the DDP door's sync_every row re-measured on the standard library's sources (2026-12-06): 2 nodes x 2
# ranks on loopback, 4,000 steps, torch DDP over the 4 ranks beside the DDP wrapper's sync_every=100 (dense inside
# the node every step, the nodes averaged through 3 bits every 100 steps: the library's defaults), seeds 0, 1, 2;
# then 2 flat ranks, seed 0. Usage: run_ddp_door.sh
cd /work/main
B=benchmarks/fewer_syncs_stdlib
for S in 0 1 2; do
  .venv/bin/gradientflow bench --quality --workload tiny_transformer --corpus stdlib --nproc 4 --nproc-per-node 2 \
    --steps 4000 --eval-every 200 --bandwidth none --timeout 9000 --seed $S --out $B/ddp_door_2x2_seed$S \
    --recipes "gf-none:sync_every=100" > $B/ddp_door_2x2_seed$S.log 2>&1
  echo done > $B/DONE_ddp_door_seed$S
done
.venv/bin/gradientflow bench --quality --workload tiny_transformer --corpus stdlib --nproc 2 \
  --steps 4000 --eval-every 200 --bandwidth none --timeout 9000 --seed 0 --out $B/ddp_door_flat_seed0 \
  --recipes "gf-none:sync_every=100" > $B/ddp_door_flat_seed0.log 2>&1
echo done > $B/DONE_ddp_door_flat
