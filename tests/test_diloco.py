"""``sync_every=H`` (DiLoCo; docs/fewer-syncs.md): the replicas step apart for H optimizer steps, then the averaged
pseudo-gradient goes through the outer exchange and the outer optimizer (Nesterov SGD) sets every replica alike.

Specifications, each on a few Gloo ranks and a model of a few dozen parameters:

- every replica holds the same bits after every outer sync (and not between them: the drift is real);
- ``sync_every=1`` is today's path, bit for bit;
- the outer step by hand on a 2-rank toy (constant gradients: the values derived below);
- the quantised outer exchange conserves the error mass (nothing lost, only delayed);
- a run resumed mid-interval (and mid-fragment) from ``comm_state_dict()`` ends on the same bits;
- 2 nodes x 2 ranks: ranks of a node identical every step (dense inside the node), nodes apart between syncs;
- a rank stopped during an outer sync: every other rank raises ``CommunicationError`` in time, nothing applied;
- bad options raise ``ValueError`` on every rank, saying what to do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from test_faults import _error_report, run_faulty
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gradientflow as gf
from gradientflow.config import GradientFlowConfig
from gradientflow.outer.exchange import Average
from gradientflow.outer.fragments import cut, due
from gradientflow.outer_options import outer_exchange_of

from _dist import run_distributed

STEPS = 12


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _lists(x: object) -> object:
    """Tensors as lists (a rank's tensors do not outlive it through the result queue); fp32 -> float -> fp32 is
    exact, so :func:`_tensors` gives the same bits back."""
    if isinstance(x, torch.Tensor):
        return ("t", x.tolist())
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return x


def _tensors(x: object) -> object:
    if isinstance(x, tuple) and len(x) == 2 and x[0] == "t":
        return torch.tensor(x[1], dtype=torch.float32)
    if isinstance(x, list):
        return [_tensors(v) for v in x]
    return x


def _run(fn, world: int, *args: object, timeout: float = 90) -> list:  # noqa: ANN001
    return [_tensors(r) for r in run_distributed(fn, world, *args, timeout=timeout)]


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    """Each rank's own data (the replicas drift apart), the same on a resumed run."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> list[torch.Tensor]:
    out = []
    for step in steps:
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
        out.append(_flat(model))
    return out


# ---- every replica identical after every outer sync -----------------------------------------------
def _replicas_worker(rank: int, world: int, options: dict) -> object:
    model, opt = _wrapped(options)
    params = _train(model, opt, rank, range(STEPS))
    assert model._gf_outer is not None
    return _lists([params, model.comm_stats(total=True), model._gf_outer.loop.runs])


@pytest.mark.parametrize(
    "options",
    [
        {"sync_every": 4, "outer_compression": "none"},
        {"sync_every": 4},  # the default outer exchange: 3 bits
        {"sync_every": 4, "sync_fragments": 2, "outer_compression": "none"},
    ],
    ids=["fp32", "3bit", "2-fragments"],
)
def test_every_replica_identical_after_every_outer_sync(options: dict) -> None:
    H, F = options["sync_every"], options.get("sync_fragments", 1)
    results = _run(_replicas_worker, 2, options)
    (a, stats, runs), (b, _, _) = results
    sizes = [p.numel() for p in _net().parameters()]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    for step in range(STEPS):
        for f, run in enumerate(runs):
            lo, hi = bounds[run[0]], bounds[run[-1] + 1]
            same = torch.equal(a[step][lo:hi], b[step][lo:hi])
            # after step k (k + 1 steps done) fragment f is synchronised iff due(k + 1, ...): the same bits then,
            # different ones otherwise (each rank trains on its own data: without the sync they would differ)
            assert same == due(step + 1, f, F, H), (step, f, same)
    assert stats["outer_syncs"] == F * (STEPS // H) and stats["inner_steps"] == STEPS
    dense = 4 * sum(sizes)  # one dense fp32 allreduce of every gradient (torch DDP's bytes per step)
    # payload_bytes is what goes to the exchange between nodes, as for every recipe: the outer syncs' bytes here
    # (none between them: a flat layout exchanges no gradient), against torch DDP's over the same inner steps
    assert stats["steps"] == STEPS and stats["dense_bytes"] == STEPS * dense
    assert stats["payload_bytes"] == stats["outer_payload_bytes"] > 0
    assert stats["outer_compression"] == options.get("outer_compression", "3bit")
    exchange = options.get("outer_compression", "3bit")
    blocks = -(-sum(sizes) // 128)  # the fragment padded to whole 128-element blocks
    if exchange == "3bit":  # 3 bits per element and a bf16 scale per block
        assert stats["outer_payload_bytes"] == (STEPS // H) * blocks * (3 * 128 // 8 + 2)
    else:
        assert stats["outer_payload_bytes"] == (STEPS // H) * dense  # one fp32 copy of the parameters per H steps
        assert stats["outer_bytes_ratio"] == pytest.approx(1 / H)
    # held between steps: the anchor (fp32, no momentum by default) and the 3-bit exchange's residual, its shard
    # padded to whole blocks (flat: one replica a rank, the whole fragment)
    residual = 4 * blocks * 128 if exchange == "3bit" else 0
    assert stats["outer_state_bytes"] == 4 * sum(sizes) + residual


def _topk_worker(rank: int, world: int) -> object:
    seen: dict[str, torch.Tensor] = {}
    # registered before the wrapper's: runs before the outer loop, holding what the inner step alone left
    hook = register_optimizer_step_post_hook(lambda o, a, k: seen.__setitem__("inner", _flat(model.module)))
    model = gf.DistributedDataParallel(_net(), sync_every=4, outer_compression="indexed-topk-2bit", outer_density=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert model._gf_outer is not None
    loop = model._gf_outer.loop
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
        assert loop.anchor is not None
        out.append((seen["inner"], _flat(model.module), torch.cat(loop.anchor).clone()))
    hook.remove()
    return _lists([out, model.comm_stats(total=True)])


def test_topk_outer_exchange_keeps_what_a_replica_did_not_send() -> None:
    """``outer_compression="indexed-topk-2bit"`` at density 0.5: the toy net's 161 parameters are 2 blocks of 128
    (padded), each rank sends its larger one.  After every sync (every 4th step) both ranks hold the same anchor, and
    each replica's parameters are that anchor minus what it did not send: they differ between the replicas, and with the
    defaults (averaging: outer lr 1, no momentum) their mean is the mean the inner step left, exactly up to fp32
    rounding.  Between syncs the parameters are the inner step's."""
    (a, stats), (b, _) = _run(_topk_worker, 2)
    for step in range(STEPS):
        (inner_a, params_a, anchor_a), (inner_b, params_b, anchor_b) = a[step], b[step]
        if (step + 1) % 4:
            assert torch.equal(params_a, inner_a) and torch.equal(params_b, inner_b), step
            continue
        assert torch.equal(anchor_a, anchor_b), step
        assert not torch.equal(params_a, params_b), "each replica keeps its own unsent drift"
        assert not torch.equal(params_a, anchor_a), "a replica keeps what it did not send (the test can fail)"
        # fp32 sums and differences of values of order 1: a few ulps
        assert torch.allclose((params_a + params_b) / 2, (inner_a + inner_b) / 2, atol=1e-6, rtol=0), step
    # one of the 2 blocks a sync: 1 int32 index, 2-bit codes, a bf16 scale, padded to 4 bytes
    assert stats["outer_syncs"] == STEPS // 4
    assert stats["outer_payload_bytes"] == (STEPS // 4) * (4 + 2 * 128 // 8 + 2 + 2)


# ---- sync_every=1 is today's path, bit for bit ----------------------------------------------------
def _today_worker(rank: int, world: int) -> object:
    runs = []
    for options in ({}, {"sync_every": 1}):
        model = gf.DistributedDataParallel(_net(), **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runs.append(_train(model, opt, rank, range(6)))
        untouched = model._gf_outer is None
    return _lists([runs[0], runs[1], untouched])


def test_sync_every_1_is_todays_path_bit_for_bit() -> None:
    for today, explicit, untouched in _run(_today_worker, 2):
        assert untouched, "sync_every=1 builds no outer loop"
        assert all(torch.equal(x, y) for x, y in zip(today, explicit))


# ---- inner steps are local steps -----------------------------------------------------------------
def _local_worker(rank: int, world: int) -> object:
    model = gf.DistributedDataParallel(_net(), sync_every=4)
    plain = _net()  # the same initial weights, no wrapper, no process group
    out = []
    for m in (model, plain):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        params = []
        for step in range(3):  # before the first sync
            opt.zero_grad()
            for micro in range(2):  # gradient accumulation, the first micro-batch inside no_sync() as under DDP
                ctx = model.no_sync() if m is model and micro == 0 else contextlib.nullcontext()
                with ctx:
                    m(_batch(rank, step, micro)).square().mean().backward()
            opt.step()
            params.append(_flat(m))
        out.append(params)
    return _lists(out)


def test_inner_steps_are_each_ranks_own_local_steps() -> None:
    """Flat, between syncs: a rank's parameters are exactly those of the bare module trained alone on its batches
    (no gradient crosses, no_sync() and accumulation as in plain torch), and the two ranks differ."""
    (wrapped0, plain0), (wrapped1, _) = _run(_local_worker, 2)
    assert all(torch.equal(w, p) for w, p in zip(wrapped0, plain0))
    assert not torch.equal(wrapped0[-1], wrapped1[-1])


def _untouched_worker(rank: int, world: int) -> list[object]:
    model = gf.DistributedDataParallel(_net(), sync_every=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[object] = []
    for step in range(2):
        opt.zero_grad()
        loss = model(_batch(rank, step)).square().mean()
        grads = torch.autograd.grad(loss, list(model.module.parameters()), retain_graph=True)
        loss.backward()
        out.append(all(torch.equal(p.grad, g) for p, g in zip(model.module.parameters(), grads)))
        opt.step()
    out.append({b.device.type for b in model.pool.buffers})
    out.append(any(p._post_accumulate_grad_hooks for p in model.module.parameters()))
    opt.zero_grad()
    out.append(all(p.grad is None for p in model.parameters()))
    return out


def test_flat_inner_steps_leave_autograds_gradients_alone() -> None:
    """Flat, nothing is ever synchronised: no hook on the parameters, ``.grad`` autograd's own tensor (stolen, as a
    plain module's, not added into a zeroed pool: on digits_wide's 8.4M parameters that cost 15-20 ms of a 50 ms
    SGD step), and the pool holds no memory (meta tensors); ``zero_grad()`` frees the gradients as torch's does."""
    for out in run_distributed(_untouched_worker, 2, timeout=60):
        assert out == [True, True, {"meta"}, False, True], out


# ---- the outer step by hand ---------------------------------------------------------------------
class _Toy(nn.Module):
    """loss = w . c: the gradient is the rank's constant c, whatever w."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0]))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


def _toy_worker(rank: int, world: int) -> tuple[list[list[float]], int]:
    model = gf.DistributedDataParallel(_Toy(), sync_every=2, outer_lr=0.7, outer_momentum=0.9, outer_compression="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    c = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([3.0, -2.0])
    out = []
    for _ in range(4):
        opt.zero_grad()
        model(c).backward()
        opt.step()
        out.append(model.module.w.detach().tolist())
    return out, model.comm_stats()["outer_state_bytes"]


def test_outer_step_by_hand_on_two_ranks() -> None:
    """Rank 0's gradient is c0 = (1, 2), rank 1's c1 = (3, -2); SGD at lr 0.25 for H = 2 steps moves rank r by
    -0.5 c_r, so the pseudo-gradients are 0.5 c_r and their mean d = 0.5 (2, 0) = (1, 0).  Nesterov (torch's
    SGD(nesterov=True)): b1 = d, w1 = w0 - 0.7 (d + 0.9 b1) = w0 - 1.33 d; the next interval drifts by the same d
    (constant gradients): b2 = 0.9 b1 + d = 1.9 d, w2 = w1 - 0.7 (d + 0.9 * 1.9 d) = w1 - 1.897 d."""
    (r0, held0), (r1, held1) = run_distributed(_toy_worker, 2, timeout=60)
    assert held0 == held1 == 16, "the anchor and the momentum, 2 fp32 values each (the dense exchange keeps none)"
    w0 = torch.tensor([1.0, -2.0])
    c0, c1 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    d = torch.tensor([1.0, 0.0])
    w1 = w0 - 1.33 * d
    w2 = w1 - 1.897 * d
    expected0 = [w0 - 0.25 * c0, w1, w1 - 0.25 * c0, w2]
    expected1 = [w0 - 0.25 * c1, w1, w1 - 0.25 * c1, w2]
    for got, want in ((r0, expected0), (r1, expected1)):
        for step, (g, e) in enumerate(zip(got, want)):
            # fp32 arithmetic on numbers of order 1: a few ulps
            assert torch.allclose(torch.tensor(g), e, atol=1e-6, rtol=0), (step, g, e)


# ---- the quantised exchange conserves the error mass -----------------------------------------------
def _mass_worker(rank: int, world: int, exchange: str) -> object:
    from gradientflow.diagnostics.watchdog import Watchdog, resolve_timeout

    group = dist.new_group(list(range(world)))
    avg = Average(outer_exchange_of(exchange), group, Watchdog(group, resolve_timeout(30, group)), fragments=1)
    out = []
    for k in range(3):  # later rounds start from a non-zero residual
        delta = torch.randn(1000, generator=torch.Generator().manual_seed(100 * rank + k))
        old = avg.residuals[0]
        old = torch.zeros(avg.shard(1000)) if old is None else old.clone()
        x = delta.clone()
        _, new = avg.average(x, 0, "test")
        assert new is not None
        avg.commit(0, new)
        if avg.keeps_unsent:  # the top-k exchange: what stays with this replica, in the parameters' units
            assert avg.residuals[0] is None, "nothing stored between syncs"
            new = new / world  # in the exchange's units, as a residual
        out.append((delta, old, x, new.clone()))
    return _lists(out)


@pytest.mark.parametrize(
    "world,exchange",
    [(2, "3bit"), (3, "3bit"), (3, "indexed-topk-2bit")],
    ids=["exchange", "ring", "indexed-topk-2bit"],
)
def test_quantised_outer_exchange_conserves_error_mass(world: int, exchange: str) -> None:
    """Every rank hands ``delta_r / N + e_r`` (its share and last sync's residual) to the exchange and keeps the
    new residual ``e'_r``: summed over ranks, ``sum delta_r / N + sum e_r == result + sum e'_r`` (what one sync
    did not deliver is delivered later, not lost), and every rank decodes the same result.  The top-k exchange
    sends 1 of the 8 blocks (density 0.1 of 1000 elements in 128-element chunks) per rank: at most 3 blocks of the
    result are not zero, and the rest of each rank's contribution is what it keeps (returned, in its parameters'
    units: ``N e'_r``; never stored, so ``e_r`` is 0 at every sync)."""
    results = _run(_mass_worker, world, exchange)
    for k in range(3):
        sent = sum(r[k][0] / world for r in results) + sum(r[k][1][:1000] for r in results)
        kept = results[0][k][2] + sum(r[k][3][:1000] for r in results)
        assert all(torch.equal(r[k][2], results[0][k][2]) for r in results), "the same average on every rank"
        # fp32 adds of values of order 1: a few ulps of the sums
        assert torch.allclose(sent, kept, atol=1e-5, rtol=0), (sent - kept).abs().max()
        assert results[0][k][3].abs().max() > 1e-3, "a 3-bit exchange leaves a residual (the test can fail)"
        assert all(r[k][3][1000:].abs().max() == 0 for r in results if r[k][3].numel() > 1000), "the pad stays 0"
        if exchange.startswith("topk"):
            result = torch.cat([results[0][k][2], torch.zeros(24)]).view(8, 128)
            assert 1 <= int((result.abs().sum(1) > 0).sum()) <= world, "each rank's own top block, nothing else"


# ---- exact resume mid-interval ------------------------------------------------------------------
def _wrapped(options: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The toy net wrapped with ``options`` and its AdamW: a run, or a resumed process, starts from these."""
    model = gf.DistributedDataParallel(_net(), **options)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _resume_worker(rank: int, world: int, options: dict, cut_at: int) -> object:
    total = 10
    model, opt = _wrapped(options)
    straight = _train(model, opt, rank, range(total))[-1]

    model, opt = _wrapped(options)
    _train(model, opt, rank, range(cut_at))
    saved = (model.module.state_dict(), opt.state_dict(), model.comm_state_dict())
    del model, opt
    model, opt = _wrapped(options)  # a fresh process's wrapper (rank 0's initial weights)
    model.module.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    model.load_comm_state_dict(saved[2])
    resumed = _train(model, opt, rank, range(cut_at, total))[-1]
    return _lists([straight, resumed])


@pytest.mark.parametrize(
    "options,cut_at",
    [
        ({"sync_every": 4, "outer_compression": "3bit"}, 6),  # 2 steps into the second interval, a residual kept
        ({"sync_every": 4, "sync_fragments": 2}, 3),  # between fragment 0's sync (step 2) and fragment 1's (step 4)
        (
            {"sync_every": 4, "outer_compression": "indexed-topk-2bit"},
            6,
        ),  # the replicas differ by what they did not send
    ],
    ids=["3bit-mid-interval", "mid-fragment", "indexed-topk-2bit"],
)
def test_exact_resume_mid_interval(options: dict, cut_at: int) -> None:
    for straight, resumed in _run(_resume_worker, 2, options, cut_at):
        assert torch.equal(straight, resumed)


def _rank0_checkpoint_worker(rank: int, world: int) -> object:
    """With this rank's own outer state, then without its parameters and optimizer state (the control)."""
    return [_rank0_checkpoint_run(rank, keep) for keep in (True, False)]


def _rank0_checkpoint_run(rank: int, keep_replica: bool) -> object:
    """A checkpoint written the torch DDP way: rank 0's model and optimizer state, loaded on every rank (as
    accelerate's save_state and Lightning's checkpoint do), beside each rank's own ``comm_state_dict()``."""
    options = {"sync_every": 4}
    total, cut_at = 10, 6
    model, opt = _wrapped(options)
    straight = _train(model, opt, rank, range(total))[-1]
    model, opt = _wrapped(options)
    _train(model, opt, rank, range(cut_at))
    shared = [(model.module.state_dict(), opt.state_dict())]
    dist.broadcast_object_list(shared, src=0)  # rank 0's, on every rank
    comm = model.comm_state_dict()
    if not keep_replica:  # the control: the outer state without this rank's parameters and optimizer state
        comm["outer"] = {k: v for k, v in comm["outer"].items() if k not in ("replica", "inner_optimizer")}
    del model, opt
    model, opt = _wrapped(options)
    model.load_comm_state_dict(comm)  # before the model and optimizer: the order does not matter
    model.module.load_state_dict(shared[0][0])
    opt.load_state_dict(shared[0][1])
    resumed = _train(model, opt, rank, range(cut_at, total))[-1]
    return _lists([straight, resumed])


def test_exact_resume_from_rank_0s_model_and_optimizer_state() -> None:
    """Between syncs the replicas' parameters and AdamW moments differ: each rank's comm_state_dict() keeps its own
    and writes them back, so a resume from rank 0's model and optimizer state is exact on every rank; without them
    (the control: a state saved before they were kept) rank 1 goes on from rank 0's replica, and the next sync
    carries that into rank 0's parameters too."""
    for (straight, resumed), (control_straight, control_resumed) in _run(_rank0_checkpoint_worker, 2):
        assert torch.equal(straight, resumed)
        # the control: the next sync (step 8) mixes rank 1's wrong start into rank 0's parameters too
        assert not torch.equal(control_straight, control_resumed), "without this rank's own state: the test can fail"


def _mismatch_worker(rank: int, world: int) -> str:
    state = gf.DistributedDataParallel(_net(), sync_every=4).comm_state_dict()
    model = gf.DistributedDataParallel(_net(), sync_every=8)
    before = _flat(model)
    try:
        model.load_comm_state_dict(state)
    except ValueError as exc:
        assert torch.equal(before, _flat(model)) and model._gf_outer is not None
        assert model._gf_outer.loop.anchor is None, "nothing loaded"
        return str(exc)
    return ""


def test_resume_with_other_options_is_refused() -> None:
    for message in run_distributed(_mismatch_worker, 2, timeout=60):
        assert "sync_every" in message and "Resume with the same options" in message


# ---- nodes of several ranks -------------------------------------------------------------------
def _nodes_worker(rank: int, world: int, options: dict) -> object:
    model = gf.DistributedDataParallel(_net(), sync_every=3, topology="2x2", **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(7):
        opt.zero_grad()
        with model.no_sync():  # gradient accumulation inside the node, as today: the second backward averages
            model(_batch(rank, step, 0)).square().mean().backward()
        model(_batch(rank, step, 1)).square().mean().backward()
        opt.step()
        out.append(_flat(model))
    return _lists([out, model.comm_stats(total=True)])


@pytest.mark.parametrize(
    "options",
    [
        {"outer_compression": "none"},
        {"outer_compression": "3bit", "comm_dtype": "bf16"},
        {"outer_compression": "indexed-topk-3bit", "outer_density": 1.0},
    ],
    ids=["fp32", "3bit-outer-bf16-inside", "indexed-topk-3bit"],
)
def test_two_nodes_of_two_ranks(options: dict) -> None:
    """``topology="2x2"``: ranks 0, 1 are node 0 and ranks 2, 3 node 1.  Inside a node the gradients are averaged
    every step (each rank has its own data, yet both hold the same bits after every step); the nodes drift apart
    and meet at every third step.  The top-k exchange (every block sent, in 3 bits) leaves each node its own
    quantisation error: the nodes then meet up to it, the two ranks of a node still on the same bits (what the node
    keeps is all-gathered inside it like the mean)."""
    results = _run(_nodes_worker, 4, options, timeout=120)
    params = [r[0] for r in results]
    topk = "topk" in options["outer_compression"]
    for step in range(7):
        assert torch.equal(params[0][step], params[1][step]) and torch.equal(params[2][step], params[3][step])
        synced = (step + 1) % 3 == 0
        if not topk:
            assert torch.equal(params[0][step], params[2][step]) == synced, step
        elif synced:  # closer than the step before the sync: 3 inner steps of drift reduced to its 3-bit error
            gap = (params[0][step] - params[2][step]).abs().max()
            assert 0 < gap < (params[0][step - 1] - params[2][step - 1]).abs().max() / 2, step
    stats = results[0][1]
    n = sum(p.numel() for p in _net().parameters())
    assert stats["steps"] == 7 and stats["dense_bytes"] == 7 * 4 * n
    bf16 = "comm_dtype" in options
    assert stats["outer_syncs"] == 2
    # between nodes only the outer syncs; inside the node every step's dense allreduce of the whole gradient in the
    # wire dtype, counted as a ring's 2 (G-1)/G of it (G = 2: once), beside the outer sync's all-gather
    assert stats["payload_bytes"] == stats["outer_payload_bytes"]
    assert stats["inter_node_bytes"] == stats["outer_inter_node_bytes"]
    assert stats["intra_node_bytes"] == stats["outer_intra_node_bytes"] + 7 * n * (2 if bf16 else 4)
    # each rank sends its half of the pseudo-gradient between nodes and all-gathers the halves inside the node
    if options["outer_compression"] == "indexed-topk-3bit":  # its half, one block, sent: index, 3-bit codes, scale, pad
        assert stats["outer_payload_bytes"] == 2 * (4 + 3 * 128 // 8 + 2 + 2)
        assert stats["outer_intra_node_bytes"] == 2 * 2 * 4 * 128, "the mean's half and the half the node keeps"
    elif bf16:  # 3-bit between nodes: halves of whole 128-element blocks (161 elements: 2 blocks, one a rank),
        # 50 bytes a block
        assert stats["outer_payload_bytes"] == 2 * 50
        assert stats["outer_intra_node_bytes"] == 2 * 4 * 128
    else:  # fp32: 81 elements a rank
        assert stats["outer_payload_bytes"] == 2 * 4 * (-(-n // 2))
        assert stats["outer_intra_node_bytes"] == stats["outer_payload_bytes"]


def _per_step_worker(rank: int, world: int) -> object:
    model, opt = _wrapped({"sync_every": 3, "outer_compression": "none"})
    seen = []
    for step in range(6):
        _train(model, opt, rank, range(step, step + 1))
        s = model.comm_stats()
        seen.append([s["payload_bytes"], s["dense_bytes"], s["outer_compression"], s.get("compression")])
    return seen


def test_comm_stats_of_a_step_counts_its_outer_sync_as_payload_bytes() -> None:
    """``comm_stats()`` (the last step): ``payload_bytes`` is the bytes that step handed to the exchange between
    nodes, so 0 on an inner step and one fp32 copy of the parameters on a sync step (H = 3: steps 3 and 6), against
    torch DDP's ``dense_bytes`` every step; ``outer_compression`` names what went on the wire ("none": fp32)."""
    n = sum(p.numel() for p in _net().parameters())
    for seen in _run(_per_step_worker, 2):
        assert [s[0] for s in seen] == [0, 0, 4 * n, 0, 0, 4 * n]
        assert all(s[1] == 4 * n and s[2] == "none" for s in seen)


# ---- a stall during an outer sync ---------------------------------------------------------------
def _stall_worker(rank: int, world: int, timeout: float, options: dict) -> dict | None:
    H = 2
    seen: dict[str, torch.Tensor] = {}
    # registered before the wrapper's: runs before the outer sync, holding what the inner step left
    register_optimizer_step_post_hook(lambda opt, a, k: seen.__setitem__("inner", _flat(model.module)))
    model = gf.DistributedDataParallel(_net(), sync_every=H, timeout=timeout, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = {"n": 0}

    def stop(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if rank == world - 1 and steps["n"] == 2 * H - 1:  # the last rank stops before the second sync's step
            os.kill(os.getpid(), signal.SIGSTOP)

    register_optimizer_step_pre_hook(stop)
    for step in range(3 * H):
        steps["n"] = step
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        t0 = time.monotonic()
        try:
            opt.step()
        except gf.CommunicationError as exc:
            report = _error_report(exc, time.monotonic() - t0)
            assert model._gf_outer is not None
            loop = model._gf_outer.loop
            report["untouched"] = torch.equal(_flat(model.module), seen["inner"])
            report["syncs"] = loop.syncs
            return report
    return None


@pytest.mark.parametrize(
    "options",
    [{"outer_compression": "none"}, {}, {"sync_delay": 1}, {"outer_compression": "indexed-topk-2bit"}],
    ids=["fp32", "3bit", "3bit-overlapped", "indexed-topk-2bit"],
)
def test_stall_during_outer_sync_raises_on_every_rank(options: dict) -> None:
    """Rank 2 of 3 stops before its fourth step; ranks 0 and 1 enter the second outer sync and wait for it: both raise
    ``CommunicationError`` within the timeout, naming rank 2, with the parameters the inner step left (the sync
    applied nothing) and one sync counted.  Overlapped (``sync_delay=1``): the exchange started after step 4 is
    waited on when it is merged, after step 5, and raises there the same way."""
    timeout = 4
    results = run_faulty(_stall_worker, 3, timeout, options, wait_for=[0, 1], timeout=timeout + 40)
    for rank, rep in results.items():
        assert rep is not None and rep["type"] == "CommunicationError", (rank, rep)
        assert rep["elapsed"] < timeout + 10, rep
        assert rep["missing"] == [2], rep
        assert "outer exchange" in rep["collective"] and "after step 4" in rep["collective"], rep
        assert rep["untouched"] and rep["syncs"] == 1, rep


# ---- bad options ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,says",
    [
        ({"sync_every": 0}, "sync_every must be an int >= 1"),
        ({"sync_every": 2.5}, "sync_every must be an int >= 1"),
        ({"outer_lr": 0.5}, "Pass sync_every=30, or drop outer_lr."),
        ({"sync_fragments": 2}, "Pass sync_every=30, or drop sync_fragments."),
        ({"sync_every": 4, "outer_lr": 0}, "outer_lr must be a number > 0"),
        ({"sync_every": 4, "outer_momentum": 1.0}, "outer_momentum must be a number in [0, 1)"),
        ({"sync_every": 4, "sync_fragments": 5}, "sync_fragments must be an int in [1, sync_every]"),
        ({"sync_delay": 1}, "Pass sync_every=30, or drop sync_delay."),
        ({"sync_every": 4, "sync_delay": 5}, "sync_delay must be an int in [0, sync_every // sync_fragments] = [0, 4]"),
        ({"sync_every": 4, "sync_fragments": 2, "sync_delay": 3}, "= [0, 2]"),
        ({"sync_every": 4, "sync_delay": -1}, "sync_delay must be an int"),
        ({"sync_every": 4, "outer_compression": "topk-fp16"}, "which has no form for the outer exchange of sync_every"),
        ({"sync_every": 4, "outer_compression": "3bit-precond"}, "is a per-step recipe"),
        ({"sync_every": 4, "outer_compression": "topk-4bit"}, "'indexed-topk-2bit', 'indexed-topk-3bit'"),
        ({"sync_every": 4, "outer_density": 0.1}, "Pass outer_compression='indexed-topk-2bit'"),
        ({"sync_every": 4, "outer_compression": "indexed-topk-2bit", "outer_density": 0}, "outer_density must be"),
        ({"outer_density": 0.1}, "outer_density applies only with sync_every > 1"),
        ({"sync_every": 4, "outer_compression": "3bt"}, "did you mean '3bit'"),
        ({"sync_every": 4, "outer_state_device": "gpu"}, "outer_state_device must be None"),
        ({"sync_every": 4, "compression": "3bit", "topology": "flat"}, "on a flat layout exchanges no gradient"),
        ({"sync_every": 4, "compression": "3bit", "topology": "flat"}, "Drop compression."),
        ({"sync_every": 4, "compression": "fp16", "topology": "flat"}, "Pass outer_compression='fp16' and drop"),
        ({"sync_every": 4, "compression": "topk-3bit", "topology": "2x2"}, "averaged densely inside a node"),
        ({"sync_every": 4, "compression": "auto"}, "on nodes of several ranks gradients are averaged densely"),
    ],
)
def test_bad_outer_options_say_what_to_do(kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        GradientFlowConfig(**kwargs)
    assert says in str(info.value), str(info.value)


def test_defaults_average_through_3_bits_where_sync_every_is_set() -> None:
    # the measured best (docs/results/fewer-syncs.md): the replicas averaged (lr 1, no momentum), 3-bit exchange
    c = GradientFlowConfig(sync_every=30)
    assert (c.outer_lr, c.outer_momentum, c.outer_compression, c.sync_fragments) == (1.0, 0.0, "3bit", 1)
    assert GradientFlowConfig().outer_lr is None, "sync_every=1: no outer option applies"


def _momentum_worker(rank: int, world: int) -> list[bool]:
    out = []
    for options in ({}, {"outer_lr": 0.7, "outer_momentum": 0.9}):
        model = gf.DistributedDataParallel(_net(), sync_every=2, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            model(_batch(rank, step, 0)).square().mean().backward()
            opt.step()
        assert model._gf_outer is not None
        out.append(model._gf_outer.loop.buf is not None)
        out.append(model.comm_state_dict()["outer"]["momentum"] is not None)
    return out


def test_averaging_keeps_no_momentum_buffer() -> None:
    # the default outer step (lr 1, no momentum) holds the anchor alone: 4 bytes a parameter, not DiLoCo's 8
    for held in run_distributed(_momentum_worker, 2, timeout=60):
        assert held == [False, False, True, True], held


def _bad_worker(rank: int, world: int) -> list[str]:
    out = []
    for kwargs in ({"sync_every": 4, "compression": "3bit"}, {"sync_every": 2, "sync_fragments": 2} if rank else {}):
        try:
            gf.DistributedDataParallel(nn.Sequential(nn.Linear(2, 1, bias=False)), **kwargs)
            out.append("built")
        except ValueError as exc:
            out.append(type(exc).__name__ + ": " + str(exc))
    model = gf.DistributedDataParallel(nn.Sequential(nn.Linear(2, 1, bias=False)), sync_every=2)
    for call in (model.join, lambda: model.register_comm_hook(None, lambda state, bucket: None)):
        try:
            call()
            out.append("accepted")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_bad_options_raise_on_every_rank() -> None:
    """The first: refused on every rank alike.  The second: rank 1 asks for more fragments than its model has
    tensors (and differs from rank 0's options): rank 1 raises its error, rank 0 hears of it (no hang)."""
    r0, r1 = run_distributed(_bad_worker, 2, timeout=60)
    assert "Drop compression." in r0[0] and "Drop compression." in r1[0]
    assert "sync_fragments=2 is more than the model's 1 trainable tensors" in r1[1]
    assert r0[1] != "built"
    for r in (r0, r1):  # what cannot work beside an outer sync: uneven inputs' shadow steps, a per-step gradient hook
        assert "join(): this model was built with sync_every=2" in r[2], r[2]
        assert "register_comm_hook: this model was built with sync_every=2" in r[3], r[3]


def test_fragments_cut_whole_tensors_about_evenly() -> None:
    assert cut([10] * 10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert cut([1, 100, 1], 3) == [[0], [1], [2]], "every fragment gets a tensor while there are enough"
    # H = 10, F = 2: fragment 0 at steps 5, 15, ..., fragment 1 at 10, 20, ... (each every H steps, staggered)
    assert [s for s in range(1, 21) if due(s, 0, 2, 10)] == [5, 15]
    assert [s for s in range(1, 21) if due(s, 1, 2, 10)] == [10, 20]


@pytest.mark.parametrize(("earlier", "row"), [("topk-2bit", "indexed-topk-2bit"), ("TopK-3bit ", "indexed-topk-3bit")])
def test_the_outer_top_k_rows_earlier_names_construct_as_outer_exchanges_only(earlier: str, row: str) -> None:
    """The indexed top-k outer exchanges were named "topk-2bit" / "topk-3bit" before; as ``outer_compression`` those
    names still mean the row (the same config, so the same bits), and the rows are refused per step, where
    "topk-3bit" is the agreed-chunks recipe: no name means two algorithms in one scope."""
    assert GradientFlowConfig(sync_every=4, outer_compression=earlier) == GradientFlowConfig(
        sync_every=4, outer_compression=row
    )
    assert GradientFlowConfig(sync_every=4, outer_compression=row).outer_compression == row
    with pytest.raises(ValueError, match="is an outer exchange"):
        GradientFlowConfig(compression=row)
    assert GradientFlowConfig(compression="topk-3bit").mechanism == "topk-quantized"
