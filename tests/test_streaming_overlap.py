"""``sync_delay=d`` (streaming DiLoCo's overlap; docs/fewer-syncs.md): a fragment's outer exchange is started at its
sync step and merged ``d`` inner steps later, the fragment then set to the new anchor plus the replica's own
progress since the sync step.

Specifications, on 2 or 4 Gloo ranks and a model of a few dozen parameters:

- the merge by hand on a 2-rank toy (constant gradients: the values derived below), where keeping the progress
  makes the overlapped run land on the blocking run's parameters: nothing is lost to the delay;
- after every merge the anchors hold the same bits on every replica, and between a sync step and its merge the
  sync changes nothing (the exchange runs beside the inner steps);
- the step that starts the exchange does not wait for a late peer (the wait moved to the merge);
- a run cut between a sync step and its merge resumes from ``comm_state_dict()`` on the same bits;
- 2 nodes x 2 ranks: dense inside the node every step, the exchange between nodes overlapped.

The stall (a rank lost while an exchange is in flight raises at the merge, on every other rank, nothing applied)
and the refused values are in tests/test_diloco.py beside the blocking sync's.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_diloco import _batch, _flat, _lists, _net, _resume_worker, _run, _Toy
from torch.optim.optimizer import register_optimizer_step_post_hook

import gradientflow as gf
from gradientflow.outer.fragments import due

from _dist import run_distributed


# ---- the merge by hand --------------------------------------------------------------------------
def _toy_worker(rank: int, world: int) -> list[list[list[float]]]:
    """The overlapped run (delay 1), then the blocking one (delay 0), in one launch."""
    runs = []
    for delay in (1, 0):
        model = gf.DistributedDataParallel(_Toy(), sync_every=2, sync_delay=delay, outer_compression="none")
        opt = torch.optim.SGD(model.parameters(), lr=0.25)
        c = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([3.0, -2.0])
        out = []
        for _ in range(6):
            opt.zero_grad()
            model(c).backward()
            opt.step()
            out.append(model.module.w.detach().tolist())
        runs.append(out)
    return runs


def test_merge_by_hand_keeps_the_progress_since_the_sync_step() -> None:
    """Rank r's gradient is the constant c_r (c0 = (1, 2), c1 = (3, -2)); SGD at lr 0.25 moves it by -0.25 c_r a step.
    H = 2, averaging (outer lr 1, no momentum), fp32, delay 1.  After step 2 the pseudo-gradients 0.5 c_r are taken
    (mean d = (1, 0)) and their exchange started; the parameters go on untouched: w0 - 0.5 c_r.  After step 3 (inner:
    w0 - 0.75 c_r) the merge: anchor w0 - d, plus the progress since step 2, -0.25 c_r.  After step 4 the next
    pseudo-gradient is again 0.5 c_r (the anchor minus w0 - d - 0.5 c_r), merged after step 5 the same way.  So
    the blocking run (delay 0) holds what the overlapped one holds after steps 3 and 5, and at its sync steps 2, 4, 6
    the overlapped replicas' mean: with constant gradients the delay costs nothing, because no inner step is
    dropped."""
    w0 = torch.tensor([1.0, -2.0])
    d = torch.tensor([1.0, 0.0])
    (over0, block0), (over1, block1) = run_distributed(_toy_worker, 2, timeout=60)
    overlapped, blocking = [over0, over1], [block0, block1]
    for rank, c in enumerate((torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0]))):
        want = [
            w0 - 0.25 * c,
            w0 - 0.5 * c,  # the exchange is in flight: nothing changed by it
            w0 - d - 0.25 * c,  # merged: the anchor and one step of progress
            w0 - d - 0.5 * c,
            w0 - 2 * d - 0.25 * c,
            w0 - 2 * d - 0.5 * c,
        ]
        for step, (got, e) in enumerate(zip(overlapped[rank], want)):
            # fp32 arithmetic on numbers of order 1: a few ulps
            assert torch.allclose(torch.tensor(got), e, atol=1e-6, rtol=0), (rank, step, got, e)
        for step in (2, 4):  # between syncs the blocking run (delay 0) holds the same values
            assert torch.allclose(torch.tensor(blocking[rank][step]), want[step], atol=1e-6, rtol=0), (rank, step)
    for step in (1, 3, 5):  # and at its sync steps it holds the mean of the overlapped replicas (their merge to come)
        mean = (torch.tensor(overlapped[0][step]) + torch.tensor(overlapped[1][step])) / 2
        for rank in (0, 1):
            assert torch.allclose(torch.tensor(blocking[rank][step]), mean, atol=1e-6, rtol=0), (rank, step)


# ---- anchors identical after every merge, nothing changed while in flight -----------------------------
STEPS = 12


def _replicas_worker(rank: int, world: int, options: dict) -> object:
    seen: dict[str, torch.Tensor] = {}
    # registered before the wrapper's: runs before the outer loop, holding what the inner step alone left
    register_optimizer_step_post_hook(lambda o, a, k: seen.__setitem__("inner", _flat(model.module)))
    model = gf.DistributedDataParallel(_net(), **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert model._gf_outer is not None
    loop = model._gf_outer.loop
    params, anchors, inner = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
        params.append(_flat(model.module))
        assert loop.anchor is not None
        anchors.append(torch.cat(loop.anchor).clone())
        inner.append(seen["inner"])
    # the last sync's exchange may still be in flight (its merge is after the last step): finish it on every rank
    # (a checkpoint does) before returning, so no rank leaves and closes its sockets while its peer still posts
    model.comm_state_dict()
    return _lists([params, anchors, inner, model.comm_stats(total=True), loop.runs])


@pytest.mark.parametrize(
    "options",
    [
        {"sync_every": 4, "sync_delay": 2, "outer_compression": "none"},
        {"sync_every": 4, "sync_delay": 1},  # the default outer exchange: 3 bits
        {"sync_every": 4, "sync_fragments": 2, "sync_delay": 2, "outer_compression": "none"},
        {"sync_every": 4, "sync_delay": 2, "outer_compression": "indexed-topk-2bit"},
    ],
    ids=["fp32-delay-2", "3bit-delay-1", "2-fragments-delay-2", "indexed-topk-2bit-delay-2"],
)
def test_anchors_agree_after_every_merge_and_the_flight_changes_nothing(options: dict) -> None:
    """After step k (k + 1 steps done) fragment f is merged iff its sync step was k + 1 - delay: then both replicas
    hold the same anchor and the fragment moved off where the inner step left it; at every other step (the sync
    step and the steps in flight included) the parameters are exactly the inner step's and the anchor unchanged.
    The replicas' parameters never agree (each keeps its own progress); syncs and bytes are counted at the merge."""
    H, F, D = options["sync_every"], options.get("sync_fragments", 1), options["sync_delay"]
    (a, anchor_a, inner_a, stats, runs), (b, anchor_b, _, _, _) = _run(_replicas_worker, 2, options)
    sizes = [p.numel() for p in _net().parameters()]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    anchor_bounds = [0]
    for run in runs:
        anchor_bounds.append(anchor_bounds[-1] + sum(sizes[i] for i in run))
    merges = []
    for step in range(STEPS):
        done = step + 1
        for f, run in enumerate(runs):
            lo, hi = bounds[run[0]], bounds[run[-1] + 1]
            alo, ahi = anchor_bounds[f], anchor_bounds[f + 1]
            merged = done > D and due(done - D, f, F, H)
            moved = not torch.equal(a[step][lo:hi], inner_a[step][lo:hi])
            assert moved == merged, (step, f, moved)
            if merged:
                merges.append(f)
                assert torch.equal(anchor_a[step][alo:ahi], anchor_b[step][alo:ahi]), (step, f)
            elif step > 0:
                assert torch.equal(anchor_a[step][alo:ahi], anchor_a[step - 1][alo:ahi]), (step, f)
            assert not torch.equal(a[step][lo:hi], b[step][lo:hi]), (step, f)
    assert merges and len(merges) < F * (STEPS // H), "the last sync started is still in flight at the end"
    assert stats["outer_syncs"] == len(merges), "a sync is counted when it is merged"
    exchange = options.get("outer_compression", "3bit")
    if exchange == "none":
        per_fragment = [4 * sum(sizes[i] for i in run) for run in runs]
        assert stats["outer_payload_bytes"] == sum(per_fragment[f] for f in merges)
    elif exchange == "indexed-topk-2bit":  # 1 of the 2 blocks: its index, 2-bit codes, scale, pad
        assert stats["outer_payload_bytes"] == len(merges) * (4 + 2 * 128 // 8 + 2 + 2)
    else:
        blocks = -(-sum(sizes) // 128)  # 3 bits an element and a bf16 scale per 128-element block
        assert stats["outer_payload_bytes"] == len(merges) * blocks * (3 * 128 // 8 + 2)


# ---- the sync step does not wait for a late peer -------------------------------------------------
LATE_S = 2.0


def _late_worker(rank: int, world: int) -> list[float]:
    """Rank 0's time in the sync step's ``optimizer.step()``, blocking (delay 0) then overlapped (delay 1)."""
    took = []
    for delay in (0, 1):
        model = gf.DistributedDataParallel(_net(), sync_every=2, sync_delay=delay, outer_compression="none")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            opt.zero_grad()
            model(_batch(rank, step)).square().mean().backward()
            if rank == 1 and step == 1:
                time.sleep(LATE_S)  # rank 1 reaches the sync step (the second) LATE_S late
            t0 = time.monotonic()
            opt.step()
            if step == 1:
                took.append(time.monotonic() - t0)
    return took


def test_the_sync_step_does_not_wait_for_a_late_peer() -> None:
    """Rank 1 reaches the sync step 2 s after rank 0.  Blocking (delay 0), rank 0's optimizer step there waits for it
    (about 2 s); overlapped (delay 1), it only posts the exchange and returns (a few ms on an idle machine; the bound
    leaves half of the 2 s for a loaded one), and the wait moves to the merge a step later."""
    blocking, overlapped = run_distributed(_late_worker, 2, timeout=60)[0]
    assert blocking > LATE_S - 0.5, blocking
    assert overlapped < LATE_S / 2, overlapped


# ---- exact resume mid-flight -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,cut_at",
    [
        ({"sync_every": 4, "sync_delay": 2}, 5),  # 3 bits: fragment 0's exchange started after step 4, merged at 6
        ({"sync_every": 4, "sync_fragments": 2, "sync_delay": 2, "outer_compression": "none"}, 3),  # 1st in flight
    ],
    ids=["3bit-in-flight", "fragments-in-flight"],
)
def test_exact_resume_with_an_exchange_in_flight(options: dict, cut_at: int) -> None:
    """``comm_state_dict()`` taken while an exchange is in flight finishes it (not merged) and saves its result; the
    resumed run merges it at the same step and ends on the bits of the run that was never cut."""
    for straight, resumed in _run(_resume_worker, 2, options, cut_at):
        assert torch.equal(straight, resumed)


# ---- nodes of several ranks ---------------------------------------------------------------------------
def _nodes_worker(rank: int, world: int) -> object:
    model = gf.DistributedDataParallel(_net(), sync_every=3, sync_delay=1, topology="2x2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert model._gf_outer is not None
    out, anchors = [], []
    for step in range(8):
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
        out.append(_flat(model.module))
        loop = model._gf_outer.loop
        assert loop.anchor is not None
        anchors.append(torch.cat(loop.anchor).clone())
    return _lists([out, anchors, model.comm_stats(total=True)])


def test_two_nodes_of_two_ranks_overlapped() -> None:
    """``topology="2x2"``, H = 3, delay 1: the ranks of a node hold the same bits after every step (dense inside the
    node, the merge applied alike on both), the two nodes' anchors agree after each merge (steps 4 and 7), and the
    nodes' parameters differ (each keeps its own step of progress)."""
    results = _run(_nodes_worker, 4, timeout=120)
    params, anchors = [r[0] for r in results], [r[1] for r in results]
    for step in range(8):
        assert torch.equal(params[0][step], params[1][step]) and torch.equal(params[2][step], params[3][step])
        assert not torch.equal(params[0][step], params[2][step]), step
        if step + 1 in (4, 7):
            assert torch.equal(anchors[0][step], anchors[2][step]), step
    stats = results[0][2]
    assert stats["outer_syncs"] == 2 and stats["steps"] == 8
