"""Fewer syncs behind ``fully_shard`` (issue 72) against the DDP wrapper's, and under what FSDP2 users do.

- The two doors on the same data per rank: ``gradientflow.fsdp.fully_shard(..., sync_every=H)`` on a (2, G) mesh
  and ``gradientflow.DistributedDataParallel(model, sync_every=H, topology="2xG")`` run the one outer loop
  (gradientflow/outer/loop.py) over the same pseudo-gradient, cut differently: FSDP's shards (dim 0 of every
  parameter split over the node) against the wrapper's shards of its flat parameter vector.
- bf16 parameters; ``MixedPrecisionPolicy``, gradient accumulation, ``clip_grad_norm_`` and compiled blocks together.
- torch's ``get_state_dict`` runs a fake optimizer step (lr 0 on a fresh optimizer): no inner step, on either door.
- A parameter smaller than the node (an empty local shard on some ranks) through the outer sync.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fsdp import _batch, _full_params, _loss, _mesh, _net, _replicas_identical, _shard

from _dist import run_distributed

H = 3


def _ddp_params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


def _train(net, rank: int, steps: int, opt=None) -> torch.optim.Optimizer:
    opt = opt or torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(steps):
        _loss(net, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _outer(net):
    from gradientflow.fsdp.counters import comms
    from gradientflow.fsdp.outer import outer_of

    found = outer_of([c for _, c in comms(net)])
    assert found is not None
    return found


# ---- 1. the two doors: the same parameters up to float reassociation ---------------------------------------------
def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(((x - y) ** 2).sum() for x, y in zip(a, b)).sqrt().item()


def _doors(rank: int, world: int, per_node: int) -> dict:
    import gradientflow as gf

    mesh = _mesh(2, per_node)
    held_out = _batch(10_000, 0)  # the same batch on every rank, seen by no step
    params: dict = {"init": [p.detach().clone() for p in _net().parameters()]}
    out: dict = {}
    for name, steps, options in (
        ("averaging", 2 * H, {"outer_compression": "none"}),
        ("nesterov", 2 * H, {"outer_compression": "none", "outer_lr": 0.7, "outer_momentum": 0.9}),
        ("3bit", 10 * H, {}),  # the default outer exchange; 10 syncs, for the model they converge to
        ("dense", 10 * H, {"outer_compression": "none"}),  # the same run unquantised: the size of 3-bit's noise
    ):
        fsdp = _shard(_net(), mesh, "gf", sync_every=H, **options)
        _train(fsdp, rank, steps)
        ddp = gf.DistributedDataParallel(_net(), sync_every=H, topology=f"2x{per_node}", **options)
        _train(ddp, rank, steps)
        params[name] = {"fsdp": _full_params(fsdp), "ddp": _ddp_params(ddp)}
        with torch.no_grad():  # after the parameters are read: the root keeps its forward's unsharded parameters
            out[f"{name}_losses"] = [F.cross_entropy(m(held_out[0]), held_out[1]).item() for m in (fsdp, ddp)]
    for name in ("averaging", "nesterov", "dense"):
        out[f"{name}_diff"] = max((a - b).abs().max().item() for a, b in zip(params[name]["fsdp"], params[name]["ddp"]))
    q, dense = params["3bit"], params["dense"]
    out["apart"] = _distance(q["fsdp"], q["ddp"])
    out["noise"] = min(_distance(q["fsdp"], dense["fsdp"]), _distance(q["ddp"], dense["ddp"]))
    out["travelled"] = _distance(q["ddp"], params["init"])
    return out


@pytest.mark.parametrize("per_node", [2, 3])
def test_fully_shard_and_the_ddp_wrapper_give_the_same_parameters(per_node: int) -> None:
    """The same pseudo-gradients averaged over the same two nodes.  Dense ("none"), with averaging and with Nesterov,
    the doors agree to float reassociation.  2x2: bit for bit (a node's two gradients summed in either order give
    the same sum; the two nodes' halves likewise).  2x3: the node's three gradients are summed in another order
    (FSDP's reduce-scatter, the wrapper's allreduce), a last-bit difference per step that AdamW carries: 1e-6
    absolute on parameters below 0.5 (about 30 ulps; measured 3e-8, one ulp, 2026-12-06).

    3-bit is not float noise.  Each door quantises its own blocks of 128 values (the wrapper's: runs of its flat
    parameter vector split over the node's ranks; FSDP's: the concatenated dim-0 shards of each rank's parameters),
    so each block has another scale and other rounding errors.  Error feedback sends every rounding error at a later
    sync, so both converge to the same model: after 10 syncs the two doors' parameters are no farther apart than
    3-bit's own noise (either door's 3-bit run against the dense one, L2: measured 0.016-0.018 between the doors,
    0.016-0.017 to dense, 2x2 and 2x3, 2026-12-06; bounded by twice that) and 10x closer than training moved them
    (measured 28-30x); their held-out losses within 1% (measured 0.05-0.06%)."""
    for r in run_distributed(_doors, 2 * per_node, per_node, timeout=240):
        tolerance = 0.0 if per_node == 2 else 1e-6
        for name in ("averaging", "nesterov", "dense"):
            assert r[f"{name}_diff"] <= tolerance, (name, r)
        assert 0 < r["apart"] <= 2 * r["noise"], r
        assert r["apart"] <= 0.1 * r["travelled"], r
        fsdp_loss, ddp_loss = r["3bit_losses"]
        assert abs(fsdp_loss - ddp_loss) <= 0.01 * ddp_loss, r


# ---- 2. what FSDP2 users do: bf16 parameters; mixed precision, accumulation, clipping, compiled blocks together --
def _users(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import gradientflow.fsdp as gf

    mesh = _mesh(2, 2)
    group = mesh.get_group("replicate")
    seen: dict = {}

    def before_sync(optimizer, args, kwargs) -> None:  # registered before fully_shard's: runs before the sync
        seen["shards"] = [p.to_local().detach().float().clone() for p in optimizer.param_groups[0]["params"]]

    register_optimizer_step_post_hook(before_sync)

    def replicas_mean() -> list[torch.Tensor]:
        """What averaging must give: the mean of the replicas' fp32 shards just before the sync."""
        means = []
        for local in seen["shards"]:
            every = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(every, local.contiguous(), group=group)
            means.append((every[0] + every[1]) / 2)
        return means

    out: dict = {}
    # bf16 parameters (model.to(bfloat16)): AdamW on bf16, the anchor fp32
    net = _shard(_net().to(torch.bfloat16), mesh, "gf", sync_every=H, outer_compression="none")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(H):
        x, y = _batch(rank, step)
        F.cross_entropy(net(x.bfloat16()), y).backward()
        opt.step()
        opt.zero_grad()
    anchor = torch.cat(_outer(net).loop.anchor)
    local = torch.cat([p.to_local().reshape(-1) for p in net.parameters()])
    mean = torch.cat([m.reshape(-1) for m in replicas_mean()])
    out["bf16"] = {
        "anchor_dtype": str(anchor.dtype),
        "param_dtype": str(local.dtype),
        "anchor_err": (anchor - mean).abs().max().item(),  # the fp32 mean of the bf16 replicas
        "params_are_anchor": torch.equal(local, anchor.bfloat16()),
        "anchor_below_bf16": not torch.equal(anchor, anchor.bfloat16().float()),
        "identical": _replicas_identical(net, mesh),
    }

    # fp32 parameters computed in bf16 (MixedPrecisionPolicy), 2 micro-steps each with the node's reduce-scatter
    # at the last only (set_requires_gradient_sync), clip_grad_norm_, both blocks compiled (as torchtitan does)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    net = _net()
    for block in (net[0], net[2]):
        block.compile(backend="aot_eager")
    net = _shard(net, mesh, "gf", sync_every=H, outer_compression="none", mp_policy=mp)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    identical, errs = [], []
    for step in range(2 * H):
        for micro in range(2):
            net.set_requires_gradient_sync(micro == 1)
            _loss(net, rank, 2 * step + micro).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        identical.append(_replicas_identical(net, mesh))
        if identical[-1]:
            anchor = _outer(net).loop.anchor[0]
            mean = torch.cat([m.reshape(-1) for m in replicas_mean()])
            errs.append((anchor - mean).abs().max().item())
            out["mp_anchor_below_bf16"] = not torch.equal(anchor, anchor.bfloat16().float())
    out["mp"] = {"identical": identical, "errs": errs, "stats": gf.comm_stats(net)}
    out["mp"]["anchor_dtype"] = str(_outer(net).loop.anchor[0].dtype)
    return out


def test_bf16_parameters_and_mixed_precision_accumulation_clipping_compiled_blocks() -> None:
    """bf16 parameters: the anchor is fp32, and after a sync it is the fp32 mean of the replicas' bf16 shards (which
    bf16 cannot hold: the anchor is not the rounded parameters), the parameters that mean rounded to bf16.
    ``MixedPrecisionPolicy(bf16, fp32)`` with accumulation, clipping and compiled blocks: the replicas meet at every
    H-th optimizer step only (micro-steps are not steps), and the anchor is the fp32 mean of the replicas' fp32
    shards (torch's sharded parameters stay fp32; bf16 is the all-gathered copy), not its bf16 rounding.  The mean is
    computed here as (a + b) / 2, the loop as anchor - ((anchor - a) / 2 + (anchor - b) / 2): a few ulps of values
    below 1 apart, 1e-6 absolute."""
    for r in run_distributed(_users, 4, timeout=240):
        b = r["bf16"]
        assert b["anchor_dtype"] == "torch.float32" and b["param_dtype"] == "torch.bfloat16"
        assert b["anchor_err"] <= 1e-6 and b["params_are_anchor"] and b["anchor_below_bf16"] and b["identical"], b
        m = r["mp"]
        assert m["identical"] == [False, False, True, False, False, True], m["identical"]
        assert m["anchor_dtype"] == "torch.float32" and r["mp_anchor_below_bf16"]
        assert max(m["errs"]) <= 1e-6, m["errs"]
        s = m["stats"]
        assert s["inner_steps"] == 2 * H and s["outer_syncs"] == 2 and s["exchanges"] == 0, s


# ---- torch's get_state_dict: its fake optimizer step is no inner step, on either door ----------------------------
def _fake_step(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import gradientflow as gf
    import gradientflow.fsdp as gff

    mesh = _mesh(2, 2)
    out: dict = {}
    for door in ("fsdp", "ddp"):
        runs = []
        for asked in (False, True):
            if door == "fsdp":
                model = _shard(_net(), mesh, "gf", sync_every=H, outer_compression="none")
            else:
                model = gf.DistributedDataParallel(_net(), sync_every=H, topology="2x2", outer_compression="none")
            # SGD's momentum buffer after the zero step is zeros, and 0.9 * 0 + g == g: the step leaves no trace in
            # it (AdamW's step counter would count it, on torch's HSDP too: torch's behaviour, not the outer loop's)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if asked:  # a checkpoint's state read before the first step (torch steps a fresh optimizer at lr 0)
                get_optimizer_state_dict(model, opt)
            _train(model, rank, 2 * H, opt)
            stats = gff.comm_stats(model) if door == "fsdp" else model.comm_stats()
            runs.append((_full_params(model) if door == "fsdp" else _ddp_params(model), stats["inner_steps"]))
        out[door] = {
            "same": all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0])),
            "inner_steps": [runs[0][1], runs[1][1]],
        }
    return out


def test_the_fake_step_of_torchs_get_state_dict_is_not_an_inner_step() -> None:
    """torch's ``get_state_dict`` / ``get_optimizer_state_dict`` on a fresh optimizer steps it once with zero
    gradients at lr 0 (torch/distributed/checkpoint/state_dict.py ``_init_optim_state``), to create its state.  That
    step trains nothing: counted as an inner step it would move every sync one step early.  Read before the first
    step, the run is the run without it, bit for bit, with as many inner steps (6, not 7), on both doors."""
    for r in run_distributed(_fake_step, 4, timeout=180):
        for door in ("fsdp", "ddp"):
            assert r[door]["inner_steps"] == [2 * H, 2 * H], (door, r[door])
            assert r[door]["same"], (door, r[door])


# ---- 5. a parameter smaller than the node: empty local shards ----------------------------------------------------
class _Tiny(torch.nn.Module):
    """``Linear(6, 4)`` then ``Linear(4, 1)``: the second's weight (1, 4) and bias (1,) have one row, so every rank of a
    node but the first holds an empty shard of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _tiny(rank: int, world: int, per_node: int, options: dict) -> dict:
    import torch.distributed as dist

    import gradientflow.fsdp as gff

    mesh = _mesh(2, per_node)
    net = _Tiny()
    for block in (net.b, net):
        gff.fully_shard(block, mesh=mesh, sync_every=2, **options)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    identical, anchors = [], []
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        identical.append(_replicas_identical(net, mesh))
        anchor = torch.cat(_outer(net).loop.anchor)
        every = [torch.empty_like(anchor) for _ in range(2)]
        dist.all_gather(every, anchor, group=mesh.get_group("replicate"))
        anchors.append(torch.equal(every[0], every[1]))
    return {"identical": identical, "anchors": anchors, "numel": [p.to_local().numel() for p in net.parameters()]}


@pytest.mark.parametrize("per_node", [3])  # 2x3 has both: ranks with part of the model, and one with none of it
@pytest.mark.parametrize(
    "options",
    [{"outer_compression": "none"}, {}, {"sync_fragments": 2}, {"outer_compression": "indexed-topk-2bit"}],
    ids=["none", "3bit", "fragments", "topk"],
)
def test_a_parameter_smaller_than_the_node(per_node: int, options: dict) -> None:
    """The second layer's weight and bias have one row: every rank of a node but the first holds an empty shard of
    them (and on 2x3 local rank 2 holds nothing at all: the first layer's 4 rows go 2, 2, 0).  Their outer sync
    exchanges empty shards: the anchors are the same bits on every replica after every step, and with the dense and
    3-bit exchanges (no fragments) the replicas are identical after each sync, apart in between.  (Top-k leaves each
    replica what it did not send; 2 fragments sync at steps 1 and 2, 3 and 4: the parameters never all meet.)"""
    results = run_distributed(_tiny, 2 * per_node, per_node, options, timeout=120)
    rows = -(-4 // per_node)  # torch's dim-0 chunks of the first layer: ceil(4 / G) rows per rank, the last fewer
    for rank, r in enumerate(results):
        local = rank % per_node
        first = max(0, min(4 - local * rows, rows))
        assert r["numel"] == [6 * first, first, 4 * (local == 0), 1 * (local == 0)], (rank, r["numel"])
        assert all(r["anchors"]), (rank, r)
        if options in ({"outer_compression": "none"}, {}):
            holds = sum(r["numel"]) > 0
            assert r["identical"] == [not holds, True, not holds, True], (rank, r)


# ---- 4. refused on every rank: mixed outer options in one model, an optimizer over both kinds of module ----------
def _refusals(rank: int, world: int) -> dict:
    import gradientflow.fsdp as gff

    mesh = _mesh(2, 2)
    out: dict = {}
    for name, blocks, root in (
        ("other_h", {"sync_every": 2}, {"sync_every": 3}),
        ("other_lr", {"sync_every": 2}, {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}),
        ("every_step_blocks", {}, {"sync_every": 2}),
    ):
        net = _net()
        for block in (net[0], net[2]):
            gff.fully_shard(block, mesh=mesh, **blocks)
        try:
            gff.fully_shard(net, mesh=mesh, **root)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    # the advice: the same options to every call
    net = _shard(_net(), mesh, "gf", sync_every=3)
    _train(net, rank, 3)
    out["advice_syncs"] = gff.comm_stats(net)["outer_syncs"]

    # one optimizer over a model of sync_every=2 and one of sync_every=1
    fewer, every = _shard(_net(), mesh, "gf", sync_every=2), _shard(_net(1), mesh, "gf", compression="none")
    opt = torch.optim.SGD([*fewer.parameters(), *every.parameters()], lr=0.1)
    for net in (fewer, every):
        _loss(net, rank, 0).backward()
    try:
        opt.step()
        out["mixed_optimizer"] = None
    except ValueError as exc:
        out["mixed_optimizer"] = str(exc)
    # the advice: an optimizer each
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (fewer, every)]
    for net, o in zip((fewer, every), opts):
        _train(net, rank, 2, o)
    out["advice_inner_steps"] = gff.comm_stats(fewer)["inner_steps"]
    return out


def test_mixed_outer_options_and_an_optimizer_over_both_kinds_are_refused_on_every_rank() -> None:
    """A root sharded with other ``sync_every`` / outer options than its blocks (sharded before it) is refused at its
    ``fully_shard`` call, on every rank (each call's options passed the ranks' agreement, so every rank sees the same
    mismatch), not at the first step; the advice (the same options to every call) then trains.  One optimizer over a
    model of ``sync_every=2`` and one of ``sync_every=1`` is refused at its first step on every rank; an optimizer
    each (the advice) steps both."""
    for r in run_distributed(_refusals, 4, timeout=120):
        for name in ("other_h", "other_lr", "every_step_blocks"):
            assert r[name] is not None and "pass the same sync_every= and outer_*= options" in r[name], (name, r)
        assert "submodule '0' was sharded with sync_every=2" in r["other_h"], r["other_h"]
        assert (
            "outer_lr=0.7" in r["other_lr"] and "submodule '0' was sharded with sync_every=1" in r["every_step_blocks"]
        )
        assert r["advice_syncs"] == 1
        assert r["mixed_optimizer"] is not None and "give each model its own optimizer" in r["mixed_optimizer"], r
        assert r["advice_inner_steps"] == 2
