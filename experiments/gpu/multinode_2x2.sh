#!/bin/bash
# Issue 37 on a lent GPU machine (16 cores): the engine's CUDA tests, then the emulated cluster of 2 nodes x 2
# ranks at 1 Gbit/s with every rank on the one GPU (Gloo carries CUDA tensors; NCCL needs a GPU per rank), so
# the emulated network runs on the CPUs, not on the training's.  Run from the repo root with .deb carried
# (Debian 12's iproute2 and its libraries: the GPU image has no `ip` or `tc`); results to $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests
mkdir -p /tmp/ipr && for f in .deb/*.deb; do dpkg -x $f /tmp/ipr; done
export PATH=/tmp/ipr/bin:/tmp/ipr/sbin:/tmp/ipr/usr/bin:/tmp/ipr/usr/sbin:$PATH
export LD_LIBRARY_PATH=/tmp/ipr/lib/x86_64-linux-gnu:/tmp/ipr/usr/lib/x86_64-linux-gnu
{ date -u; uname -r; ip -V; nproc; nvidia-smi -L; git log -1 --format=%h 2>/dev/null
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"; } 2>&1 | tee $OUT/env.txt
# 1. the engine's contracts on CUDA tensors (test_devices: dense, CSC, GradScaler, quantised, two-level 2x2)
timeout ${T_TESTS:-170} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_devices.py \
  "tests/test_cli.py::test_bench_on_cuda_two_steps" -rs 2>&1 | tee $OUT/cuda_tests.log | tail -25
date -u
# 2. two-level against flat, every recipe, on the emulated 2 x 2 at 1 Gbit/s, ranks on the GPU
M="gf-none gf-none@flat gf-fp16 gf-fp16@flat gf-topk-fp16 gf-topk-fp16@flat gf-auto gf-auto@flat ddp ddp-fp16 ddp-powersgd"
for w in ${WORKLOADS:-transformer resnet50}; do
  if [ $w = resnet50 ]; then a="--workload resnet50"; else a="--workload tiny_transformer --optimizer adamw"; fi
  timeout ${T_BENCH:-190} python3 -m gradientflow.cli bench $a --device cuda --nproc 4 --nproc-per-node 2 \
    --bandwidth 1gbit --steps ${STEPS:-10} --warmup 3 --no-alone --modes $M --netns-prefix gfg --out /tmp/mg/$w \
    > /tmp/mg-$w.log 2>&1; echo "bench $w rc=$?"
  grep -v -i -E "warn|hostname" /tmp/mg-$w.log | tail -30 > $OUT/bench_$w.log
  cp /tmp/mg/$w/table.md $OUT/${w}_table.md; cp /tmp/mg/$w/results.json $OUT/${w}_results.json
  cat /tmp/mg/$w/table.md; date -u
done
ip netns list
