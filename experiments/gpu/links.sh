#!/bin/bash
# The link matrix with every rank on the GPU: the emulated network runs on the 16 CPU cores, not on the
# training's.  Run on a lent GPU machine from the repo root with .deb carried (iproute2 and its libraries).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
mkdir -p /tmp/ipr && for f in .deb/*.deb; do dpkg -x $f /tmp/ipr; done
export PATH=/tmp/ipr/bin:/tmp/ipr/sbin:/tmp/ipr/usr/bin:/tmp/ipr/usr/sbin:$PATH
export LD_LIBRARY_PATH=/tmp/ipr/lib/x86_64-linux-gnu:/tmp/ipr/usr/lib/x86_64-linux-gnu
uname -r; ip -V; nproc; nvidia-smi -L
for p in ${PROFILES:-1g-burst 1g-small 1g-small-jumbo 1g-htb 10g}; do
  timeout 200 python3 -m gradientflow.cli bench --links $p --device cuda --modes gf-topk-fp16 ddp \
    --steps ${STEPS:-10} --warmup 3 --no-alone --netns-prefix gfg --out /tmp/lg/$p 2>&1 | grep -v -i -E "warn|hostname" | tail -1
  cp /tmp/lg/$p/matrix.md $OUT/$p.md
  date -u
done
ip netns list
