#!/bin/bash
# A B A B: the session-start commit (14512d3) against the final tree, each run with torch DDP beside it; run then
# from /work/main into benchmarks/regression_check_2026-11-27/ (a record: both trees knew the modes by their old
# names, gf-fp32 and gf-fp16-csc-slice, today gf-none and gf-topk-fp16).  The table:
# python3 experiments/ab/regression_check_2026-11-27_summary.py
cd /work/main
for rep in 1 2; do  # then 3 4 with the order new, base
  for v in base new; do
    if [ $v = base ]; then src=/tmp/ab/base/src; else src=/work/main/src; fi
    PYTHONPATH=$src .venv/bin/python -m gradientflow.cli bench --workload resnet50 --nproc 2 --bandwidth 1gbit \
      --steps 10 --warmup 3 --no-alone --modes gf-fp32 gf-fp16 gf-fp16-csc-slice ddp ddp-fp16 \
      --netns-prefix gfab --out benchmarks/regression_check_2026-11-27/$v-$rep > benchmarks/regression_check_2026-11-27/$v-$rep.log 2>&1
    echo "$v $rep rc $?" >> /dev/null
  done
done
