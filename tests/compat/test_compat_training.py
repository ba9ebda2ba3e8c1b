"""DDP's user-facing training behaviours, each checked against torch DDP or a local model.

The local oracle: one model fed the *global* batch (every rank's inputs concatenated) with a
mean loss has exactly the gradient DDP averages from equal local batches.
"""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradientflow as gf

from _dist import run_distributed
from _oracle import assert_same_grads, assert_same_params, batch, pair

# Both DDPs search for unused parameters, as torch DDP requires when some go without a gradient.
UNUSED = {"find_unused_parameters": True}

Out = namedtuple("Out", "main aux")


class Tied(nn.Module):
    """One Parameter used by two modules, and one registered under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 8, bias=False)
        self.head = nn.Linear(8, 6, bias=False)
        self.head.weight = nn.Parameter(self.emb.weight.detach().t().contiguous())
        self.shared = nn.Parameter(torch.ones(8))
        self.alias = self.shared  # the same Parameter under a second name
        self.emb2 = self.emb  # a module registered twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x)) * self.alias + self.shared
        return self.head(h) + self.emb2(x).sum(1, keepdim=True)


def _steps(models, rank: int, steps: int, loss_fn, opt_cls=torch.optim.SGD, check=None, **opt_kw) -> None:
    opts = [opt_cls(m.parameters(), **(opt_kw or {"lr": 0.1})) for m in models]
    for step in range(steps):
        for m, o in zip(models, opts):
            o.zero_grad()
            loss_fn(m, rank, step).backward()
        if check is not None:
            check(step)
        for o in opts:
            o.step()


def _tied_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(Tied)
    assert len(list(ours.parameters())) == len(list(ref.parameters())) == 3
    _steps(
        [ref, ours],
        rank,
        3,
        lambda m, r, s: m(batch(r, s)).pow(2).mean(),
        check=lambda s: assert_same_grads(ref, ours, what=f"step {s}"),
    )
    assert_same_params(ref, ours)


def test_tied_and_shared_parameters() -> None:
    run_distributed(_tied_worker, 2)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.left = nn.Linear(8, 2)
        self.right = nn.Linear(8, 2)
        self.never = nn.Linear(8, 2)  # no rank ever uses it

    def forward(self, x: torch.Tensor, right: bool = True) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.left(h) + (self.right(h) if right else 0)


def _grad_none_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(Branchy, UNUSED, UNUSED)
    # None after construction and after a forward, as torch DDP.
    assert all(p.grad is None for p in ours.parameters())
    ours(batch(rank, 0)).sum()
    assert all(p.grad is None for p in ours.parameters())

    def loss(m, r, s):  # `right` used on rank 0 only at odd steps, by nobody at even steps
        return m(batch(r, s), right=(s % 2 == 1 and r == 0)).pow(2).mean()

    def check(step: int) -> None:
        assert_same_grads(ref, ours, what=f"step {step}")
        assert ours.module.never.weight.grad is None
        assert (ours.module.right.weight.grad is None) == (step % 2 == 0)

    # AdamW: decay and momentum would move a parameter whose .grad were a zero instead of None.
    _steps([ref, ours], rank, 4, loss, torch.optim.AdamW, check=check, lr=0.05, weight_decay=0.1)
    assert_same_params(ref, ours)


def test_grad_is_none_until_produced_and_for_unused_parameters() -> None:
    run_distributed(_grad_none_worker, 2)


def _static_graph_worker(rank: int, world_size: int) -> list[int]:
    """static_graph=True: the used-parameter exchange runs on the first step only, with the same result."""
    ref, ours = pair(Branchy, {"static_graph": True}, {"find_unused_parameters": True})
    control = []

    def check(step: int) -> None:
        assert_same_grads(ref, ours, what=f"step {step}")
        assert ours.module.never.weight.grad is None
        control.append(ours.comm_stats()["control_bytes"])

    _steps([ref, ours], rank, 3, lambda m, r, s: m(batch(r, s)).pow(2).mean(), check=check)
    return control


def test_static_graph_exchanges_used_flags_once() -> None:
    n_params = len(list(Branchy().parameters()))
    # the first step's exchange: one int32 count of users per parameter (torch's local_used_map)
    assert run_distributed(_static_graph_worker, 2) == [[4 * n_params, 0, 0]] * 2


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.counts = nn.Parameter(torch.arange(4), requires_grad=False)  # non-float parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale + self.counts.sum() * 0


def _frozen_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(Frozen, UNUSED, UNUSED)

    def loss(m, r, s):
        m.module.a.requires_grad_(s % 2 == 0)  # GAN-style: toggled between steps
        return m(batch(r, s)).pow(2).mean()

    def check(step: int) -> None:
        assert_same_grads(ref, ours, what=f"step {step}")
        assert (ours.module.a.weight.grad is None) == (step % 2 == 1)

    _steps([ref, ours], rank, 4, loss, check=check)
    assert_same_params(ref, ours)
    # Frozen when wrapped, unfrozen later: torch DDP would silently never synchronise it.
    ours.module.scale.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'scale' had requires_grad=False when the model was wrapped"):
        ours(batch(rank, 9))


def test_frozen_and_toggled_requires_grad() -> None:
    run_distributed(_frozen_worker, 2)


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)
        self.c = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor):
        return {"out": Out(self.a(x), [self.b(x), "label", 3]), "unused": self.c(x), "meta": None}


def _outputs_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(Structured, UNUSED, UNUSED)

    def loss(m, r, s):
        out = m(batch(r, s))
        return out["out"].main.pow(2).mean() + out["out"].aux[0].mean()  # out["unused"] is not in the loss

    _steps([ref, ours], rank, 3, loss, check=lambda s: assert_same_grads(ref, ours, what=f"step {s}"))
    assert ours.module.c.weight.grad is None


def test_structured_outputs_with_unused_parts() -> None:
    run_distributed(_outputs_worker, 2)


def _forwards_worker(rank: int, world_size: int) -> None:
    """Two forwards then one backward; no_grad evaluation between steps; a second backward."""
    ref, ours = pair(lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))

    def two_forwards(m, r, s):
        return m(batch(r, s)).pow(2).mean() + m(batch(r, s + 50)).abs().mean()

    def check(step: int) -> None:
        assert_same_grads(ref, ours, what=f"step {step}")
        for m in (ref, ours):  # evaluation between steps changes nothing
            m.eval()
            with torch.no_grad():
                m(batch(rank, 99))
            m.train()

    _steps([ref, ours], rank, 3, two_forwards, check=check)
    assert_same_params(ref, ours)
    # A second backward in the same step (dense): both backwards are synchronised, so .grad is what
    # a local model on the global batch accumulates over two backwards.  (torch DDP does not
    # synchronise a backward without a new forward: it leaves average + local, different per rank.)
    _, ours = pair(lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))  # no BatchNorm: batch-size free
    local = copy.deepcopy(ours.module)
    loss = ours(batch(rank, 7)).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()
    glob = local(torch.cat([batch(r, 7) for r in range(world_size)])).pow(2).mean()
    glob.backward(retain_graph=True)
    glob.backward()
    for a, b in zip(local.parameters(), ours.module.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5)
    # With sparse communication .grad holds what was sent: a second synchronised backward before
    # zero_grad() would send it twice, so it is refused.
    _, sparse = pair(lambda: nn.Linear(6, 64), {"density": 0.5, "chunk_size": 16})
    loss = sparse(batch(rank, 1)).pow(2).mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second synchronised backward"):
        loss.backward()


def test_two_forwards_eval_between_steps_and_second_backward() -> None:
    run_distributed(_forwards_worker, 2)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = checkpoint(lambda t: torch.relu(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)


def _checkpoint_worker(rank: int, world_size: int, reentrant: bool) -> None:
    torch.manual_seed(0)
    ours = gf.DistributedDataParallel(Checkpointed(reentrant))
    torch.manual_seed(0)
    local = Checkpointed(False)
    for step in range(2):
        ours.zero_grad()
        local.zero_grad()
        x = batch(rank, step).requires_grad_(reentrant)  # reentrant checkpointing needs an input that requires grad
        ours(x).pow(2).mean().backward()
        glob = torch.cat([batch(r, step) for r in range(world_size)])
        local(glob).pow(2).mean().backward()
        for a, b in zip(local.parameters(), ours.module.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    run_distributed(_checkpoint_worker, 2, reentrant)


def _no_sync_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(lambda: nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 2)))
    for m in (ref, ours):
        with m.no_sync():
            m(batch(rank, 0)).sum().backward()
            m(batch(rank, 1)).sum().backward()
        m(batch(rank, 2)).sum().backward()
    assert_same_grads(ref, ours)


def test_no_sync_accumulation() -> None:
    run_distributed(_no_sync_worker, 2)


# ---- gradient clipping after backward (the user's clip_grad_norm_, plain and under GradScaler) --------
_CLIP = 0.05  # below every step's gradient norm in these workers (asserted), so clipping acts each step


def _clip_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    return m(batch(rank, step)).pow(2).mean()


def _clip_dense_worker(rank: int, world_size: int) -> None:
    """Dense: the user's loop with clipping gives torch DDP's gradients and parameters."""
    make = lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # noqa: E731
    ref, ours = pair(make)
    ref_s, ours_s = pair(make)  # the AMP recipe: scale, unscale_, clip, scaler.step
    runs = [
        (ref, None),
        (ours, None),
        (ref_s, torch.amp.GradScaler("cpu", init_scale=2.0**8)),
        (ours_s, torch.amp.GradScaler("cpu", init_scale=2.0**8)),
    ]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m, _ in runs]
    for step in range(4):
        norms = []
        for (m, scaler), opt in zip(runs, opts):
            opt.zero_grad()
            loss = _clip_loss(m, rank, step)
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), _CLIP)))
            (opt.step() if scaler is None else scaler.step(opt))
            if scaler is not None:
                scaler.update()
        assert min(norms) > _CLIP, norms  # the clip acted
        # The norm is taken of the averaged gradient, so it is DDP's (1e-6: Gloo's sum grouping).
        torch.testing.assert_close(torch.tensor(norms[1::2]), torch.tensor(norms[0::2]), atol=1e-6, rtol=1e-6)
        assert_same_grads(ref, ours, what=f"step {step}")
        assert_same_grads(ref_s, ours_s, what=f"GradScaler, step {step}")
    assert_same_params(ref, ours)
    assert_same_params(ref_s, ours_s)


def test_clip_grad_norm_after_backward_matches_ddp() -> None:
    run_distributed(_clip_dense_worker, 2)


def _clip_csc_worker(rank: int, world_size: int) -> None:
    """CSC: clipping scales what this step sent and nothing else; later steps are unaffected.

    Three wrappers see the same batches and never step (the optimizer is the user's; here its
    effect would only make the models differ): ``plain`` is not clipped, ``clipped`` is, ``amp``
    runs the AMP recipe with a registered GradScaler.  Each step the clipped gradient must be the
    plain one times clip_grad_norm_'s coefficient, and the residuals must stay equal: a clip that
    leaked into the pool's next step, or into what is kept back, would break both.
    """
    make = lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))  # noqa: E731
    kw = dict(density=0.25, chunk_size=8, warmup_steps=0, fusion_threshold_mb=0.001)
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        models.append(gf.DistributedDataParallel(make(), **kw))
    plain, clipped, amp = models
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # a power of two: unscale_ is exact
    amp.register_grad_scaler(scaler)
    opt = torch.optim.SGD(amp.parameters(), lr=0.0)  # unscale_ needs the optimizer holding the grads
    for step in range(6):
        for m in models:
            m.zero_grad()
        _clip_loss(plain, rank, step).backward()
        _clip_loss(clipped, rank, step).backward()
        scaler.scale(_clip_loss(amp, rank, step)).backward()
        scaler.unscale_(opt)
        sent = [p.grad.clone() for p in plain.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in sent]))
        assert norm > _CLIP, float(norm)
        coef = _CLIP / (norm + 1e-6)  # clip_grad_norm_'s coefficient
        assert float(torch.nn.utils.clip_grad_norm_(clipped.parameters(), _CLIP)) == float(norm)
        torch.nn.utils.clip_grad_norm_(amp.parameters(), _CLIP)
        scaler.update()
        for g, a, b in zip(sent, clipped.parameters(), amp.parameters()):
            torch.testing.assert_close(a.grad, g * coef, atol=0, rtol=1e-6)  # one multiply's rounding
            assert torch.equal(b.grad, a.grad)  # the scale is a power of two: same bits
        for x, y, z in zip(*(m._gf_engine.sync.res.unscaled("v") for m in models)):
            assert torch.equal(x, y) and torch.equal(x, z), f"residual differs at step {step}"
    assert plain.comm_stats()["payload_bytes"] == clipped.comm_stats()["payload_bytes"] > 0


def test_clip_grad_norm_with_csc_scales_only_what_was_sent() -> None:
    run_distributed(_clip_csc_worker, 2)
