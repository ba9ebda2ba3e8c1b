#!/bin/bash
# After the staging change (two-level, Gloo, CUDA: a dense exchange between nodes on the host copy, the copy back
# queued): the CUDA tests, then ResNet-50 on the emulated 2 x 2 at 1 Gbit/s, ranks on the GPU.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests
mkdir -p /tmp/ipr && for f in .deb/*.deb; do dpkg -x $f /tmp/ipr; done
export PATH=/tmp/ipr/bin:/tmp/ipr/sbin:/tmp/ipr/usr/bin:/tmp/ipr/usr/sbin:$PATH
export LD_LIBRARY_PATH=/tmp/ipr/lib/x86_64-linux-gnu:/tmp/ipr/usr/lib/x86_64-linux-gnu
date -u; nvidia-smi -L
timeout ${T_TESTS:-60} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_devices.py -k cuda 2>&1 | tee $OUT/cuda_tests.log | tail -4
date -u
timeout ${T_BENCH:-100} python3 -m gradientflow.cli bench --workload resnet50 --device cuda --nproc 4 --nproc-per-node 2 \
  --bandwidth 1gbit --steps 8 --warmup 3 --no-alone --netns-prefix gfg --out /tmp/r50f \
  --modes gf-topk-fp16 gf-topk-fp16@flat gf-auto gf-auto@flat gf-fp16 gf-fp16@flat > /tmp/r50f.log 2>&1
echo "bench rc=$?"; grep -v -i -E "warn|hostname" /tmp/r50f.log | tail -8 > $OUT/bench.log
cp /tmp/r50f/table.md $OUT/r50_table.md; cp /tmp/r50f/results.json $OUT/r50_results.json
grep -A7 "step ratio" /tmp/r50f/table.md; grep "^| gf" /tmp/r50f/table.md | head -6; date -u
