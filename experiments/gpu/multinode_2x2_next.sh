#!/bin/bash
# For the next session that is lent a GPU (issue 37's last GPU rows): the transformer (AdamW) on the emulated 2 x 2 at
# 1 Gbit/s after the staging change (its fp16 and CSC rows were measured before it), and ResNet-50's torch peers
# (DDP, + fp16 hook, + PowerSGD) in one launch with gf-none beside its flat twin.  From the repository root, `.deb/`
# carried (Debian 12's iproute2: the image has no `ip` or `tc`); ~7 min of device time in all.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests
mkdir -p /tmp/ipr && for f in .deb/*.deb; do dpkg -x $f /tmp/ipr; done
export PATH=/tmp/ipr/bin:/tmp/ipr/sbin:/tmp/ipr/usr/bin:/tmp/ipr/usr/sbin:$PATH
export LD_LIBRARY_PATH=/tmp/ipr/lib/x86_64-linux-gnu:/tmp/ipr/usr/lib/x86_64-linux-gnu
date -u; nvidia-smi -L
# two wrapped models in one backward on the GPU (Gloo, bytes staged through the host), then the engine's CUDA tests
timeout ${T_TESTS:-120} python3 -m pytest -q -p no:cacheprovider -n 4 tests/compat/test_compat_two_models.py tests/test_devices.py \
  -k cuda 2>&1 | tee $OUT/cuda_tests.log | tail -4
timeout ${T_TR:-150} python3 -m gradientflow.cli bench --workload tiny_transformer --optimizer adamw --device cuda \
  --nproc 4 --nproc-per-node 2 --bandwidth 1gbit --steps 20 --warmup 5 --no-alone --netns-prefix gfg --out /tmp/tr \
  --modes gf-none gf-none@flat gf-fp16 gf-fp16@flat gf-topk-fp16 gf-topk-fp16@flat gf-auto gf-auto@flat \
          ddp ddp-fp16 ddp-powersgd > /tmp/tr.log 2>&1
echo "transformer rc=$?"; cp /tmp/tr/table.md $OUT/transformer_table.md; cp /tmp/tr/results.json $OUT/transformer_results.json
grep -v -i -E "warn|hostname" /tmp/tr.log | tail -8 > $OUT/transformer.log; date -u
timeout ${T_R50:-180} python3 -m gradientflow.cli bench --workload resnet50 --device cuda --nproc 4 --nproc-per-node 2 \
  --bandwidth 1gbit --steps 8 --warmup 3 --no-alone --netns-prefix gfg --out /tmp/r50 \
  --modes gf-none gf-none@flat ddp ddp-fp16 ddp-powersgd > /tmp/r50.log 2>&1
echo "resnet50 rc=$?"; cp /tmp/r50/table.md $OUT/r50_table.md; cp /tmp/r50/results.json $OUT/r50_results.json
grep -v -i -E "warn|hostname" /tmp/r50.log | tail -8 > $OUT/r50.log; date -u
