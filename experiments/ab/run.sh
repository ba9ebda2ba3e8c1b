#!/bin/bash
# A regression check of one commit against another on the emulated 1 Gbit/s link (2 ranks, one per node), each
# run timing the given gradientflow modes beside torch DDP in one launch, the two trees in turn
# base new base new new base new base, so slow drifts of the machine hit both alike:
#
#   bash experiments/ab/run.sh BASE_REV NEW_REV OUT MODE [MODE ...]     # from the repository root, as root
#   python3 experiments/ab/summary.py OUT                                 # the table: each mode's step over DDP's
#
# MODE is spelled as both trees know it: a tree from before the recipe table's mode names (2026-12) runs
# gf-fp16-csc-slice, not gf-topk-fp16 (bench.mode_names.OLD_MODES); the table shows the table's names.
#
# Each tree's src/ comes from `git archive` (the working tree is not used); the bench is this checkout's
# environment (.venv).  Every run holds the emulated cluster's lock, as the other netns benches do.
set -euo pipefail
base=$1 new=$2 out=$3
shift 3
modes=("$@")
mkdir -p "$out"
for v in base new; do
  rev=$([ $v = base ] && echo "$base" || echo "$new")
  rm -rf "$out/$v-src" && mkdir -p "$out/$v-src"
  git archive "$rev" src | tar -x -C "$out/$v-src"
  echo "$v $(git rev-parse --short "$rev")" >> "$out/revs.txt"
done
exec 9>/tmp/gf-netns.lock
flock 9
i=0
for v in base new base new new base new base; do
  i=$((i + 1))
  PYTHONPATH="$out/$v-src/src" .venv/bin/python -m gradientflow.cli bench --workload resnet50 --nproc 2 --bandwidth 1gbit \
    --steps 10 --warmup 3 --no-alone --modes "${modes[@]}" ddp --netns-prefix gfab --out "$out/$v-$i" \
    > "$out/$v-$i.log" 2>&1
  echo "run $i ($v) done $(date -u +%H:%M:%S)"
done
rm -rf "$out/base-src" "$out/new-src"
