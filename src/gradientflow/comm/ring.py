"""Gradientflow's ring allreduce, built only on ``P2POp`` + ``batch_isend_irecv``.

It runs on any backend with point-to-point operations (Gloo on CPU, NCCL on GPU) and is
synchronous: :func:`gradientflow.comm.collectives.start_allreduce` with ``algorithm="ring"``
returns an already-completed handle.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Size of one pipelined message, and how many are in flight (posted receives) at once.
# Tuned on 2-3 Gloo ranks over loopback on 2 shared cores (benchmarks/allreduce_bw_2r_tuning.md;
# noisy: the same schedule measured 0.77x and 1.04x of native in one run).  1-4 MB pieces were
# consistently slower at 64-256 MB (0.6-0.9x): every Gloo point-to-point message is a rendezvous
# between two processes' transport threads, while the add that pipelining hides is only ~10% of
# a loopback transfer.  16 MB was best or tied; depth 2 ties depth 4 and keeps the cached receive
# buffer at 32 MB.  Tensors up to N * 16 MB are therefore sent as one piece per segment.
DEFAULT_PIPELINE_BYTES = 16 << 20
DEFAULT_PIPELINE_DEPTH = 2


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``parts`` near-equal pieces of ``range(n)``, larger ones first."""
    q, rem = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + q + (i < rem)
        bounds.append((start, end))
        start = end
    return bounds


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    accumulate_dtype: torch.dtype | None = None,
    pipeline_bytes: int = DEFAULT_PIPELINE_BYTES,
    pipeline_depth: int = DEFAULT_PIPELINE_DEPTH,
    timeout: timedelta | None = None,
) -> None:
    """In-place SUM allreduce of ``tensor`` over ``group``: a pipelined ring of point-to-point ops.

    Every rank must call it with a tensor of the same numel, dtype and arguments.  Group rank
    ``r`` sends only to ``r+1`` and receives only from ``r-1`` (mod N).

    1. Cut the flat tensor into N near-equal segments, and every segment into the same
       number K of pieces of at most ``pipeline_bytes`` (on the wire).
    2. Reduce-scatter, steps t = 0..N-2: send segment ``r-t``, receive segment ``r-t-1`` into
       scratch and add it to our own copy.  After N-1 steps rank r holds the full sum of
       segment ``r+1``.
    3. All-gather, steps t = N-1..2N-3 (u = t-N+1): send segment ``r+1-u``, receive segment
       ``r-u`` straight into the tensor.
    4. Pipelining: the (step, piece) units are taken in order with ``pipeline_depth`` of them
       in flight: when a unit has arrived and been added, the unit ``depth`` places later is
       posted, so the transport moves the next pieces while we add this one, across step
       boundaries too (piece k of step t+1 is piece k of step t's sum, already done).  Each
       unit's (send, recv) pair is one ``batch_isend_irecv`` batch, so NCCL cannot deadlock
       on it; waiting on the batch also frees its send buffer for reuse.
    5. Wait for every batch before returning: the tensor and scratch are then free.

    ``accumulate_dtype`` (e.g. ``torch.float32`` on an fp16/bf16 tensor): partial sums are kept
    *and sent* in that dtype during the reduce-scatter, and rounded to the tensor's dtype once,
    by the owner of each segment; the all-gather then moves the tensor's dtype.  This costs
    1.5x the wire bytes of a pure fp16 ring (0.75x of an fp32 one).  Adding in fp32 but
    forwarding a partial rounded to fp16 at every hop would be no more accurate than a plain
    fp16 sum: a sum of two fp16 values computed in fp32 then rounded is exactly the correctly
    rounded fp16 sum that ``half + half`` (and Gloo's/NCCL's fp16 reduction) already computes.

    Memory: a receive buffer of ``pipeline_depth`` pieces on ``tensor.device``, kept between
    calls (see :func:`_scratch`); with ``accumulate_dtype``, two buffers of ``numel/N``
    elements of that dtype, allocated per call.  A non-contiguous ``tensor`` raises ``ValueError``
    rather than silently costing two copies: pass ``tensor.contiguous()`` and copy back.

    ``timeout``: every point-to-point wait is bounded by it (``RuntimeError`` when it passes);
    ``None`` = the process group's.
    """
    if not tensor.is_contiguous():
        raise ValueError(
            "ring_allreduce needs a contiguous tensor (it sends views of its flat storage); "
            "reduce t.contiguous() and copy the result back"
        )
    if pipeline_bytes < 1 or pipeline_depth < 1:
        raise ValueError(f"pipeline_bytes and pipeline_depth must be >= 1, got {pipeline_bytes}, {pipeline_depth}")
    if accumulate_dtype == tensor.dtype:
        accumulate_dtype = None
    if accumulate_dtype is not None and not (accumulate_dtype.is_floating_point and tensor.is_floating_point()):
        raise ValueError(f"accumulate_dtype must be a floating dtype for a floating tensor, got {accumulate_dtype}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("ring_allreduce called on a rank that is not a member of the group")
    n = tensor.numel()
    if world == 1 or n == 0:
        return

    flat = tensor.view(-1)
    # 1. Segments and pieces.  K is the same for all segments (sizes differ by at most one
    # element) so sender and receiver always agree on a piece's size.
    seg = _split(n, world)
    seg_len = seg[0][1] - seg[0][0]
    acc_dtype = accumulate_dtype or tensor.dtype
    piece_elems = max(1, pipeline_bytes // acc_dtype.itemsize)
    k_pieces = math.ceil(seg_len / piece_elems)
    slot = math.ceil(seg_len / k_pieces)  # the largest piece
    pieces = [[(s + a, s + b) for a, b in _split(e - s, k_pieces)] for s, e in seg]
    total = 2 * (world - 1) * k_pieces  # units (t, k), numbered j = t*K + k
    last_rs = world - 2  # last reduce-scatter step
    if accumulate_dtype is None:
        # Unit j receives into slot j % depth of a cached scratch buffer: at most `depth` pieces
        # in flight, and unit j+depth is posted only after unit j has been added.
        depth = max(1, min(pipeline_depth, k_pieces))
        bufs = [_scratch(depth * slot, tensor.dtype, tensor.device)]
    else:
        # A partial sum must live until it is forwarded one step (K units) later, so the whole
        # segment is in flight, double-buffered: step t receives into bufs[t % 2] while step
        # t+1 sends from bufs[(t-1) % 2].  Not cached: this path is not the engine's.
        depth = k_pieces
        bufs = [torch.empty(k_pieces * slot, dtype=acc_dtype, device=tensor.device) for _ in range(2)]

    def peer(group_rank: int) -> int:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    nxt, prv = peer((rank + 1) % world), peer((rank - 1) % world)

    def send_seg(t: int) -> int:
        return (rank - t) % world if t <= last_rs else (rank + 1 - (t - world + 1)) % world

    def recv_seg(t: int) -> int:
        return send_seg(t + 1)  # what arrives at step t is forwarded at step t+1

    def scratch(j: int, length: int) -> torch.Tensor:
        t = j // k_pieces
        at = (j % depth) * slot
        return bufs[t % 2 if accumulate_dtype is not None else 0][at : at + length]

    def send_buf(j: int) -> torch.Tensor:
        t, k = divmod(j, k_pieces)
        a, b = pieces[send_seg(t)][k]
        if accumulate_dtype is None or t > last_rs:
            return flat[a:b]
        if t == 0:  # stage our own piece in the accumulate dtype (bufs[1] is free at t=0)
            return bufs[1][k * slot : k * slot + b - a].copy_(flat[a:b])
        return scratch(j - k_pieces, b - a)  # the partial sum received and added at step t-1

    def post(j: int) -> list[dist.Work]:
        t, k = divmod(j, k_pieces)
        ops = []
        a, b = pieces[recv_seg(t)][k]
        if a != b:  # empty pieces (tensors shorter than N * K) are skipped by both ends
            dst = flat[a:b] if t > last_rs else scratch(j, b - a)
            ops.append(dist.P2POp(dist.irecv, dst, prv, group))
        a, b = pieces[send_seg(t)][k]
        if a != b:
            ops.append(dist.P2POp(dist.isend, send_buf(j), nxt, group))
        return dist.batch_isend_irecv(ops) if ops else []

    def reduce(j: int) -> None:
        t, k = divmod(j, k_pieces)
        a, b = pieces[recv_seg(t)][k]
        if a == b or t > last_rs:
            return  # empty piece, or all-gather: the data landed in place
        if accumulate_dtype is None:
            flat[a:b].add_(scratch(j, b - a))
            return
        partial = scratch(j, b - a)
        partial.add_(flat[a:b])  # fp32 += fp16: the add is done in the accumulate dtype
        if t == last_rs:
            flat[a:b].copy_(partial)  # the only rounding to the tensor's dtype

    # 2-4. Units in order j = 0, 1, ...: wait for unit j, add it, post unit j + depth.  Unit
    # j+depth needs unit j+depth-K (same piece, previous step), already done as depth <= K.
    # Every rank posts in this same order, which is how sends and receives between the same
    # pair of ranks are matched.
    inflight = deque(post(j) for j in range(min(depth, total)))
    for j in range(total):
        for work in inflight.popleft():
            work.wait() if timeout is None else work.wait(timeout)
        reduce(j)
        if j + depth < total:
            inflight.append(post(j + depth))
    # 5. Every batch has been waited on: all sends and receives are complete.
    logger.debug("ring allreduce: %d x %s over %d ranks, %d pieces/segment", n, tensor.dtype, world, k_pieces)


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable receive buffer of at least ``numel`` elements (``pipeline_depth`` pieces).

    Kept between calls because on a CPU rank a fresh buffer costs a page fault per 4 KB on
    first touch, a large part of the ring's time at 256 MB (measured:
    docs/results/benchmarks.md#figures-behind-the-codes-comments).  Only one ring runs at a time per process
    (they are synchronous, from one thread), so one buffer per (device, dtype) suffices.  Its size is
    bounded by depth * pipeline_bytes.
    """
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]
