#!/bin/bash
# Issue 73: the failure run with steps of realistic length: the 256x4 transformer (d_model 256, 4 layers: about 3
# steps a second on 3 replicas of this 2-core machine, against 12 for the 128x2 of the runs before), the same
# schedules of 12 faults (kills and stops, some inside syncs) at the same steps, seeds 0 and 1, gradientflow's
# replicas= only (torchft's DiLoCo ran beside it at 128x2, seed 0), on a quiet CPU.
# As root. Usage: benchmarks/replicas_under_failures_256x4.sh
cd /work/main
for S in 0 1; do
  PYTHONPATH=src .venv/bin/python experiments/replicas_under_failures.py --size 256x4 --steps 4000 --every 30 \
    --failures 12 --timeout 20 --stop-seconds 30 --grace 240 --limit 5400 --seed $S --systems gradientflow \
    --out benchmarks/replicas_under_failures_256x4_seed$S
done
