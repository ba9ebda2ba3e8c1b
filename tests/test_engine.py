"""Core engine: parity with torch DDP, lazy-allreduce bucket counts, misuse errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradientflow as gf
from gradientflow.engine.pool import Scratch, plan_layout

from _dist import run_distributed

THETAS = [0, 0.001, 1, 25, math.inf]


class Net(nn.Module):
    """Conv + BatchNorm + an optional branch that some ranks skip on some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)
        self.extra = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        h = nn.functional.adaptive_avg_pool2d(h, 4).flatten(1)
        h = torch.relu(self.fc1(h))
        out = self.fc2(h)
        return out + self.extra(h) if use_extra else out


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _parity_worker(rank: int, world_size: int, thetas: list[float], steps: int) -> None:
    for theta in thetas:
        for unused in (False, True):
            torch.manual_seed(0)
            ref_net = Net()
            torch.manual_seed(0)
            our_net = Net()
            ref = nn.parallel.DistributedDataParallel(ref_net, find_unused_parameters=unused)
            ours = gf.DistributedDataParallel(our_net, fusion_threshold_mb=theta, find_unused_parameters=unused)
            opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
            opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
            gen = torch.Generator().manual_seed(100 + rank)
            for step in range(steps):
                use_extra = (step + rank) % 2 == 0 if unused else True
                x = torch.randn(6, 3, 8, 8, generator=gen)
                y = torch.randint(0, 10, (6,), generator=gen)
                for model, opt in ((ref, opt_ref), (ours, opt_ours)):
                    opt.zero_grad()  # set_to_none=True: the pool must survive it
                    nn.functional.cross_entropy(model(x, use_extra=use_extra), y).backward()
                # fp32, same inputs; only the order of Gloo's summation may differ: 1e-6 absolute.
                for a, b in zip(_grads(ref_net), _grads(our_net)):
                    torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=f"theta={theta} step={step}")
                opt_ref.step()
                opt_ours.step()
            for a, b in zip(ref_net.parameters(), our_net.parameters()):
                torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=f"params theta={theta} unused={unused}")
            for a, b in zip(ref_net.buffers(), our_net.buffers()):
                torch.testing.assert_close(b, a, msg=f"buffers theta={theta}")
            # Every .grad is a view of the pool (zero copy), even after zero_grad(set_to_none=True).
            pool = ours.pool.buffers[0]
            for p in our_net.parameters():
                assert p.grad.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()


def _no_sync_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref_net, our_net = Net(), Net()
    our_net.load_state_dict(ref_net.state_dict())
    ref = nn.parallel.DistributedDataParallel(ref_net)
    ours = gf.DistributedDataParallel(our_net, fusion_threshold_mb=0.001)
    gen = torch.Generator().manual_seed(7 + rank)
    batches = [(torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)) for _ in range(3)]
    synced, local = {}, {}
    for name, model in (("ref", ref), ("ours", ours)):
        with model.no_sync():
            for x, y in batches[:2]:
                nn.functional.cross_entropy(model(x, use_extra=True), y).backward()
        local[name] = [p.grad.clone() for p in model.module.parameters()]
        x, y = batches[2]
        nn.functional.cross_entropy(model(x, use_extra=True), y).backward()
        synced[name] = _grads(model.module)
    for a, b in zip(local["ref"], local["ours"]):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    for a, b in zip(synced["ref"], synced["ours"]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    # Inside no_sync nothing was exchanged: the local sums differ between ranks.
    gathered = [torch.zeros_like(local["ours"][0]) for _ in range(world_size)]
    dist.all_gather(gathered, local["ours"][0])
    assert not torch.equal(gathered[0], gathered[1])
    assert ours.comm_stats()["collectives"] == len(ours.pool.layout.buckets)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradients_and_parameters_match_torch_ddp(world_size: int) -> None:
    run_distributed(_parity_worker, world_size, THETAS, 20, timeout=300)


def test_no_sync_accumulates_then_matches_ddp() -> None:
    run_distributed(_no_sync_worker, 2)


def test_bucket_count_follows_layout_and_threshold() -> None:
    # Three Linear(16, 16): weight 1024 B, bias 64 B, laid out in reverse registration order.
    numels = [256, 16, 256, 16, 256, 16]
    keys = [(torch.float32, torch.device("cpu"))] * 6
    order = [5, 4, 3, 2, 1, 0]
    count = lambda theta_mb: len(plan_layout(numels, keys, order, theta_mb * 1024 * 1024).buckets)
    assert count(0) == 6  # one collective per tensor
    assert count(0.001) == 3  # 1048.6 B: bias+weight (64 + 1024 B) closes each bucket
    assert count(0.0005) == 3  # 524 B: a bias alone is too small, bias+weight is enough
    assert count(1) == 1
    assert count(math.inf) == 1
    layout = plan_layout(numels, keys, order, 0.001 * 1024 * 1024)
    assert [b.params for b in layout.buckets] == [(5, 4), (3, 2), (1, 0)]
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 272), (272, 544), (544, 816)]


def _count_worker(rank: int, world_size: int) -> list[int]:
    counts = []
    for theta in (0, 0.001, math.inf):
        torch.manual_seed(0)
        model = gf.DistributedDataParallel(
            nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]), fusion_threshold_mb=theta
        )
        for _ in range(2):  # the second step runs on the layout re-laid in observed order
            model.zero_grad()
            model(torch.randn(2, 16)).sum().backward()
        stats = model.comm_stats()
        expected = len(
            plan_layout(
                [p.numel() for p in model.parameters()],
                [(torch.float32, torch.device("cpu"))] * 6,
                model.pool.layout.order,
                theta * 1024 * 1024,
            ).buckets
        )
        assert stats["collectives"] == expected
        assert stats["payload_bytes"] == stats["dense_bytes"] == 4 * (3 * 16 * 17)
        counts.append(stats["collectives"])
    return counts


def test_collectives_per_step_match_layout() -> None:
    assert run_distributed(_count_worker, 2) == [[6, 3, 1]] * 2


def _mismatch_worker(rank: int, world_size: int) -> str:
    width = 16 if rank == 0 else 17
    try:
        gf.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width)))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_different_models_raise_naming_first_mismatch() -> None:
    messages = run_distributed(_mismatch_worker, 2, timeout=60)
    for msg in messages:
        assert "1.weight" in msg and "[16, 4]" in msg and "[17, 4]" in msg, msg


def test_without_process_group_raises() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        gf.DistributedDataParallel(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fusion_threshold_mb": -1},
        {"comm_dtype": "int8"},
        {"algorithm": "tree"},
        {"density": 0},
        {"density": 1.5},
        {"chunk_size": 0},
        {"warmup_steps": -1},
        {"momentum": 1.0},
    ],
)
def test_bad_options_raise_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        gf.GradientFlowConfig(**kwargs)


def _dead_peer_worker(rank: int, world_size: int) -> str:
    model = gf.DistributedDataParallel(nn.Linear(64, 64))
    if rank == 1:
        return "left"  # leaves the group (the harness destroys it) instead of joining backward
    try:
        model(torch.randn(2, 64)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_dead_peer_raises_instead_of_hanging() -> None:
    message, _ = run_distributed(_dead_peer_worker, 2, timeout=100)
    assert "peer may have died" in message, message


class _SharedUnderCheckpoint(nn.Module):
    """``lin`` is used inside a reentrant checkpoint and outside it: its gradient is produced twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)
        return self.lin(inner)


def _twice_worker(rank: int, world_size: int) -> str:
    model = gf.DistributedDataParallel(_SharedUnderCheckpoint())
    try:
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_gradient_produced_twice_raises() -> None:
    for message in run_distributed(_twice_worker, 2):
        assert "produced a gradient twice" in message and "'lin." in message, message


def test_scratch_hands_out_disjoint_views_and_keeps_its_buffer_between_steps() -> None:
    s = Scratch(torch.device("cpu"))
    first = [s.take(10, torch.float16), s.take(5, torch.float16)]  # first step: fresh tensors
    assert all(t._base is None for t in first)
    s.reset()  # step used 15 fp16: one buffer of 15
    c, d = s.take(10, torch.float16), s.take(5, torch.float16)
    assert c.data_ptr() + 10 * 2 == d.data_ptr()  # consecutive, disjoint views of one buffer
    base = c.data_ptr()
    s.reset()
    assert s.take(12, torch.float16).data_ptr() == base  # same size class: the buffer is kept
    s.reset()  # used 12 of 15: kept (not below half)
    e = s.take(20, torch.float16)  # more than the buffer: a fresh tensor, the buffer untouched
    assert e.data_ptr() != base and e.numel() == 20
    s.reset()  # grows to 20
    assert s.take(4, torch.float16).numel() == 4
    s.reset()  # used 4 < 20 / 2: shrinks to 4
    f = s.take(4, torch.float16)
    assert f._base is not None and f._base.numel() == 4
    s.reset()
    s.reset()  # a step that took nothing in fp16 frees the buffer
    assert s.take(1, torch.float16)._base is None


def _resolved_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(
        nn.Linear(300, 10), comm_dtype="half", density=0.5, dense_1d=False, warmup_steps=0
    )
    cfg = model.config
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    return {"comm_dtype": cfg.comm_dtype, "chunk_size": cfg.chunk_size, "stats": model.comm_stats()}


def test_half_and_auto_resolve_for_the_model_and_device() -> None:
    """comm_dtype="half" is bf16 on CPU; chunk_size="auto" gives 3010 parameters 16-element chunks."""
    r0, r1 = run_distributed(_resolved_worker, 2)
    assert r0["comm_dtype"] == r1["comm_dtype"] == "bf16"
    # 3010 // 2000 = 1 -> raised to the floor of 16: 189 chunks.
    assert r0["chunk_size"] == r1["chunk_size"] == 16
    st = r0["stats"]
    assert st["n_chunks"] == 189 and st["selected_chunks"] == 95  # ceil(0.5 * 189)
    assert st["payload_bytes"] == 4 * 189 + 2 * 16 * 95  # fp32 scores + bf16 rows


def test_plan_layout_tail_bytes_cuts_the_last_bucket_to_its_trailing_parameters():
    """CSC slices: the last bucket holds the most trailing parameters that fit in tail_bytes."""
    f32 = (torch.float32, torch.device("cpu"))
    numels = [100, 100, 30, 20, 10]  # fp32: 400, 400, 120, 80, 40 bytes
    plain = plan_layout(numels, [f32] * 5, [0, 1, 2, 3, 4], threshold_bytes=800)
    assert [b.params for b in plain.buckets] == [(0, 1), (2, 3, 4)]
    cut = plan_layout(numels, [f32] * 5, [0, 1, 2, 3, 4], threshold_bytes=800, tail_bytes=130)
    assert [b.params for b in cut.buckets] == [(0, 1), (2,), (3, 4)]  # 80 + 40 <= 130 < 120 + 80 + 40
    assert [(b.start, b.end) for b in cut.buckets] == [(0, 200), (200, 230), (230, 260)]
    assert [b.index for b in cut.buckets] == [0, 1, 2]

    # a last bucket already within tail_bytes is left alone; a last parameter over it goes alone
    def cut_at(tail: float) -> list[tuple[int, ...]]:
        return [b.params for b in plan_layout(numels, [f32] * 5, [0, 1, 2, 3, 4], 800, tail).buckets]

    assert cut_at(240) == [(0, 1), (2, 3, 4)]
    assert cut_at(10) == [(0, 1), (2, 3), (4,)]


def _create_graph_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    local = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    local.load_state_dict(net.state_dict())
    model = gf.DistributedDataParallel(net)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    for step, set_to_none in enumerate((True, False, False, True)):
        model.zero_grad(set_to_none=set_to_none)
        model(x).pow(2).sum().backward(create_graph=True)
        want = torch.autograd.grad(local(x).pow(2).sum(), list(local.parameters()))
        for w in want:
            dist.all_reduce(w)
            w /= world_size
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad.detach(), w, atol=1e-6, rtol=0, msg=f"step {step}")


def test_backward_with_create_graph_synchronises_the_gradient() -> None:
    """``backward(create_graph=True)`` (gradient penalties, higher-order terms): autograd then
    accumulates out of place, replacing a bound ``.grad`` by a new tensor; the engine must take that
    tensor into the pool, from ``None`` gradients and from zeroed ones alike.  Oracle: the local
    gradients, averaged by hand."""
    run_distributed(_create_graph_worker, 2)
