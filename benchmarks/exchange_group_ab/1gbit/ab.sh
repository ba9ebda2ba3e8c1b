#!/bin/bash
# A B A B (worktrees as ../ab.sh) on the emulated 1 Gbit/s link (2 ranks, one per node): 71f1fe3 (old) and HEAD (new)
exec 9>/tmp/gf-netns.lock; flock 9
for i in 1 2; do for v in old new; do  # runs 3-4: "for i in 3 4; do for v in new old"
  PYTHONPATH=/tmp/wt_$v/src /work/main/.venv/bin/gradientflow bench --workload resnet50 --nproc 2 --bandwidth 1gbit --steps 10 --warmup 3 --no-alone \
    --modes gf-fp16-csc-slice gf-auto ddp --netns-prefix gfab --out /tmp/ab2_${v}_$i > /tmp/ab2_${v}_$i.log 2>&1
  echo "$v $i rc=$? $(date -u +%H:%M)"; grep -E "^\| (gf|ddp)" /tmp/ab2_${v}_$i/table.md | head -3
done; done
