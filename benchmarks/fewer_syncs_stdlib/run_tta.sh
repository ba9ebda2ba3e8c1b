#!/bin/bash
# Issue 72: time to torch HSDP's final loss behind an emulated 100 Mbit/s link between 2 nodes of 2 ranks (root:
# network namespaces, tc), torch's HSDP and DDP beside gradientflow's per-step fully_shard (3 bits between nodes) and
# its fewer syncs (H = 30 and H = 100, given 1.5x the steps), 1,000 steps, the standard library's sources.
# The loopback quality launch the bench always runs first is cut to 50 steps (its table is not used).
cd /work/main
B=benchmarks/fewer_syncs_stdlib
.venv/bin/gradientflow bench --quality --workload tiny_transformer --corpus stdlib --nproc 4 --nproc-per-node 2 \
  --steps 50 --eval-every 50 --bandwidth 100mbit --tta-size 128x2 --tta-steps 1000 --timeout 5000 --seed 0 \
  --tta-recipes hsdp fsdp-3bit "fsdp-none:sync_every=30,steps=1.5" "fsdp-none:sync_every=100,steps=1.5" \
  --out $B/tta_100mbit > $B/tta_100mbit.log 2>&1
echo done > $B/DONE_tta
