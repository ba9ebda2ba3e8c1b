"""The FSDP door's exchange between nodes overlapping the next module's backward, and ``torch.amp.GradScaler``.

Specifications, on 2 nodes x 2 Gloo ranks (tests/_dist.py), the MLP of tests/test_fsdp.py sharded per block and at
the root:

- ``overlap=True`` posts each module's exchange in its hook and finishes it later: while the next
  module's backward computes, the exchange is in flight; ``overlap=False`` (the default) waits in the hook;
- both give the same ``.grad`` bit for bit, so the same parameters and residuals, on every path torch takes after
  the hook: fp32 reduce (the hook's tensor viewed as ``.grad``), a bf16 reduce of fp32 parameters (torch casts it),
  an fp16 reduce (torch post-divides it), two backward passes into one ``.grad`` (torch adds to it), and every
  recipe family (dense, quantised, top-k);
- under a ``GradScaler`` registered with ``model.register_grad_scaler(scaler)`` the residuals are in the units of
  the loss scale of each step: a run whose scale doubles every step is bit for bit the unscaled run (the scales
  are powers of two, so every scaling is exact), and a step whose gradients overflow is skipped on every rank,
  leaves every residual finite and the run goes on.
"""

from __future__ import annotations

import pytest
import torch
from test_fsdp import _loss, _mesh, _net, _replicas_identical, _shard

from _dist import run_distributed


def _residuals(net) -> list[torch.Tensor]:
    """Every gradientflow module's error-feedback state on this rank (residual, then ``q`` where kept)."""
    out = []
    for m in net.modules():
        comm = getattr(m, "_gf_fsdp", None)
        if comm is not None and comm.feedback is not None:
            out += [comm.feedback.err.clone(), *([comm.feedback.sq.clone()] if comm.feedback.sq is not None else [])]
    return out


# ---- the exchange is in flight during the next module's backward ------------------------------------------------


def _in_flight(rank: int, world: int) -> dict:
    from gradientflow.fsdp import overlap

    mesh = _mesh(2, 2)
    seen = {}
    for on in (True, False):
        net = _shard(_net(), mesh, "gf", compression="3bit", overlap=on)
        counts: list[int] = []
        # the gradient of block 0's output is computed by the Tanh between the blocks, after block 2's hook ran
        # (torch runs a block's post-backward when the gradient of its input is done): the next module's backward

        def watch(_module, _inputs, output, counts=counts) -> None:
            output.register_hook(lambda _grad: counts.append(len(overlap._IN_FLIGHT)))

        net[0].register_forward_hook(watch)
        _loss(net, rank, 0).backward()
        seen[on] = (counts, len(overlap._IN_FLIGHT), [p.grad.to_local().clone() for p in net.parameters()])
    return {
        "overlapped": seen[True][0],
        "waited": seen[False][0],
        "after_backward": [seen[True][1], seen[False][1]],
        "same_grads": all(torch.equal(a, b) for a, b in zip(seen[True][2], seen[False][2])),
    }


def test_the_exchange_is_in_flight_during_the_next_modules_backward() -> None:
    for r in run_distributed(_in_flight, 4, timeout=120, ranks_per_node=2):
        assert r["overlapped"] == [1]  # block 2's exchange, posted and not yet finished
        assert r["waited"] == [0]  # overlap=False: the hook finished it
        assert r["after_backward"] == [0, 0]  # backward() returns with nothing in flight
        assert r["same_grads"]


# ---- overlap=True gives overlap=False's gradients bit for bit, on each of torch's paths after the hook -----------

CASES = [
    ("none", None),
    ("3bit", None),
    ("3bit-precond", None),
    ("topk-3bit", None),
    ("topk-fp16", None),
    ("none", torch.bfloat16),  # fp32 parameters, bf16 reduce: torch casts the hook's output into .grad
    ("3bit", torch.bfloat16),
    ("none", torch.float16),  # fp16 reduce: torch post-divides the hook's output
]


def _parity(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh(2, 2)
    out = {}
    for recipe, reduce_dtype in CASES:
        runs = {}
        for on in (True, False):
            options = {"compression": recipe, "overlap": on}
            if recipe.startswith("topk"):
                options.update(warmup_steps=0, density=0.5)  # sparse from the first exchange
            if reduce_dtype is not None:
                options["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
            net = _shard(_net(), mesh, "gf", **options)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for step in range(3):
                # two backward passes into one .grad each step: torch adds the second's shard to the first's
                for micro in range(2):
                    _loss(net, rank, 2 * step + micro).backward()
                opt.step()
                opt.zero_grad()
            runs[on] = ([p.detach().to_local().clone() for p in net.parameters()], _residuals(net))
        key = f"{recipe} {reduce_dtype}"
        out[key] = all(torch.equal(a, b) for a, b in zip(runs[True][0], runs[False][0])) and all(
            torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1])
        )
    return out


def test_overlap_gives_the_waiting_hooks_gradients_bit_for_bit() -> None:
    for r in run_distributed(_parity, 4, timeout=240, ranks_per_node=2):
        assert all(r.values()), r


# ---- GradScaler -----------------------------------------------------------------------------------------------


def _scaled(rank: int, world: int, recipe: str, overlap: bool) -> dict:
    mesh = _mesh(2, 2)
    options = {"compression": recipe, "overlap": overlap}
    options |= {"warmup_steps": 0, "density": 0.5} if recipe.startswith("topk") else {}
    steps, overflow_at = 6, 4

    # the unscaled run: the reference for the scaled one's first steps
    plain = _shard(_net(), mesh, "gf", **options)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    reference = []
    for step in range(overflow_at):
        _loss(plain, rank, step).backward()
        opt.step()
        opt.zero_grad()
        reference.append(([p.detach().to_local().clone() for p in plain.parameters()], _residuals(plain)))

    net = _shard(_net(), mesh, "gf", **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_factor=2.0, growth_interval=1)
    net.register_grad_scaler(scaler)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    out: dict = {"same_as_unscaled": [], "scales": [], "finite": [], "identical": [], "skipped_unchanged": None}
    for step in range(steps):
        before = [p.detach().to_local().clone() for p in net.parameters()]
        loss = _loss(net, rank, step)
        if step == overflow_at and rank == 0:
            loss = loss * torch.tensor(float("inf"))  # one rank's gradients overflow
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        params = [p.detach().to_local().clone() for p in net.parameters()]
        if step < overflow_at:
            ref_params, ref_res = reference[step]
            out["same_as_unscaled"].append(
                all(torch.equal(a, b) for a, b in zip(params, ref_params))
                and all(torch.equal(a, b) for a, b in zip(_residuals(net), ref_res))
            )
        if step == overflow_at:
            out["skipped_unchanged"] = all(torch.equal(a, b) for a, b in zip(params, before))
        out["scales"].append(scaler.get_scale())
        out["finite"].append(all(bool(torch.isfinite(t).all()) for t in _residuals(net)))
        out["identical"].append(_replicas_identical(net, mesh))
    out["params_finite"] = all(bool(torch.isfinite(p.to_local()).all()) for p in net.parameters())
    return out


@pytest.mark.parametrize(("recipe", "overlap"), [("3bit-precond", False), ("topk-3bit", False), ("3bit-precond", True)])
def test_grad_scaler_residuals_in_loss_scale_units_and_finite_after_an_overflow(recipe: str, overlap: bool) -> None:
    for r in run_distributed(_scaled, 4, recipe, overlap, timeout=240, ranks_per_node=2):
        # the scale doubles after every finite step (growth_interval=1): 16, 32, 64, 128; each step's parameters
        # and residuals are the unscaled run's bit for bit (a residual left in the last step's units would not be)
        assert r["same_as_unscaled"] == [True] * 4
        # step 4 overflows on rank 0 only: skipped on every rank (the scale halves from 256 everywhere), then the
        # run goes on doubling it
        assert r["scales"] == [32.0, 64.0, 128.0, 256.0, 128.0, 256.0]
        assert r["skipped_unchanged"]
        assert all(r["finite"]) and r["params_finite"]
        assert all(r["identical"])


def test_register_grad_scaler_takes_a_grad_scaler_only() -> None:
    from gradientflow.fsdp.hooks import GradientflowFSDPModule

    with pytest.raises(TypeError, match="takes a torch.amp.GradScaler"):
        GradientflowFSDPModule.register_grad_scaler(torch.nn.Linear(1, 1), object())  # type: ignore[arg-type]
