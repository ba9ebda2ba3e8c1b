#!/bin/bash
# A B A B (git worktree add /tmp/wt_old 71f1fe3; git worktree add /tmp/wt_new 3c92fb4): the ResNet-50 loopback step of the compressed modes beside torch DDP, at 71f1fe3 (old) and HEAD (new)
for i in 1 2; do for v in old new; do
  PYTHONPATH=/tmp/wt_$v/src /work/main/.venv/bin/gradientflow bench --workload resnet50 --nproc 2 --bandwidth none --steps 10 --warmup 2 --no-alone \
    --modes gf-fp16-csc-slice gf-auto ddp --out /tmp/ab_${v}_$i > /tmp/ab_${v}_$i.log 2>&1
  echo "$v $i rc=$?"; grep -E "^\| (gf|ddp|torch)" /tmp/ab_${v}_$i/table.md | head -4
done; done
