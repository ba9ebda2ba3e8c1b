#!/bin/bash
# ResNet-50 on the emulated 2 x 2 with ranks on the GPU, each recipe beside its flat twin in a launch of its own
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
mkdir -p /tmp/ipr && for f in .deb/*.deb; do dpkg -x $f /tmp/ipr; done
export PATH=/tmp/ipr/bin:/tmp/ipr/sbin:/tmp/ipr/usr/bin:/tmp/ipr/usr/sbin:$PATH
export LD_LIBRARY_PATH=/tmp/ipr/lib/x86_64-linux-gnu:/tmp/ipr/usr/lib/x86_64-linux-gnu
i=0
for M in "gf-auto gf-auto@flat" "gf-topk-fp16 gf-topk-fp16@flat" "gf-none gf-none@flat gf-fp16 gf-fp16@flat ddp ddp-fp16"; do
  i=$((i+1)); date -u
  timeout ${T_BENCH:-100} python3 -m gradientflow.cli bench --workload resnet50 --device cuda --nproc 4 --nproc-per-node 2 \
    --bandwidth 1gbit --steps ${STEPS:-8} --warmup 3 --no-alone --modes $M --netns-prefix gfg --out /tmp/r50/$i > /tmp/r50-$i.log 2>&1
  echo "launch $i ($M) rc=$?"
  cp /tmp/r50/$i/table.md $OUT/r50_${i}_table.md 2>/dev/null
  { grep -v -i -E "warn|hostname" /tmp/r50-$i.log | tail -8; grep -i -B2 -A8 "error\|mismatch\|Traceback" /tmp/r50/$i/launch-main.log | head -60; } > $OUT/r50_${i}.log
  tail -4 $OUT/r50_${i}.log
done
ip netns list
