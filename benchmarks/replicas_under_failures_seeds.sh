#!/bin/bash
# Issue 73: the failure run again on seeds 1 and 2 (another model init, other batches and another schedule of 12
# faults each), gradientflow's replicas= only (torchft's DiLoCo ran beside it at seed 0), on a quiet CPU.
# As root. Usage: benchmarks/replicas_under_failures_seeds.sh
cd /work/main
for S in 1 2; do
  PYTHONPATH=src .venv/bin/python experiments/replicas_under_failures.py --steps 4000 --every 30 --failures 12 \
    --timeout 20 --stop-seconds 30 --grace 120 --limit 3600 --seed $S --systems gradientflow \
    --out benchmarks/replicas_under_failures_seed$S
done
