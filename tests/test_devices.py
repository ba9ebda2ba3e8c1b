"""The engine's contracts on every device this machine has: CPU always, CUDA where present.

The same workers run on CPU tensors here and on CUDA tensors on a GPU machine (Gloo carries CUDA
tensors: two ranks may share one GPU), so the device paths (fused score kernel, a GradScaler's
scale as a device tensor, no host reads) are checked by the very assertions that pass on CPU:

1. dense: gradients equal torch DDP's on the same device, with no host synchronisation;
2. CSC (fp16 wire, exact and sampled scores, fp32 and bf16 models): every rank sends the same
   chunks, nothing is lost (sum of applied gradients + mean residual = sum of mean local
   gradients), and one host read per step (the finite check);
3. CSC with a GradScaler: the residuals equal those of an unscaled twin (power-of-two scales).
4. two-level (4 ranks as 2 nodes of 2): dense equals torch DDP within the summation tolerance, the
   quantised recipe leaves every rank identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradientflow as gf

from _dist import run_distributed

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _device(kind: str, rank: int) -> torch.device:
    return torch.device("cpu") if kind == "cpu" else torch.device("cuda", rank % torch.cuda.device_count())


def _ids(device: torch.device) -> list[int] | None:
    return None if device.type == "cpu" else [device.index]


def _net(device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # 64*48+48 + 48*48+48 + 48*4+4 = 5668 parameters: 5 chunks of 1024 (+ a short one), 88 of 64
    return nn.Sequential(nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 4)).to(device, dtype)


def _data(rank: int, step: int, device: torch.device, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 64, generator=gen)
    return x.to(device, dtype), torch.randint(0, 4, (16,), generator=gen).to(device)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)


def _dense_worker(rank: int, world_size: int, kind: str) -> None:
    device = _device(kind, rank)
    ref = nn.parallel.DistributedDataParallel(_net(device), device_ids=_ids(device))
    ours = gf.DistributedDataParallel(_net(device), device_ids=_ids(device))
    for step in range(3):
        x, y = _data(rank, step, device)
        for m in (ref, ours):
            m.zero_grad()
            _loss(m, x, y).backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            assert b.grad.device == device
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)  # Gloo's fp32 sum, grouping only
        assert ours.comm_stats()["host_syncs"] == 0


@pytest.mark.parametrize("kind", DEVICES)
def test_dense_matches_torch_ddp_without_host_reads(kind: str) -> None:
    run_distributed(_dense_worker, 2, kind)


def _csc_worker(rank: int, world_size: int, kind: str, dtype: torch.dtype, chunk_size: int, score: str) -> list:
    device = _device(kind, rank)
    model = gf.DistributedDataParallel(
        _net(device, dtype),
        device_ids=_ids(device),
        comm_dtype="fp16",
        density=0.25,
        warmup_steps=0,
        chunk_size=chunk_size,
        chunk_score=score,
    )
    assert model._gf_engine.sync.sampled == (score == "sampled_l1")
    params = list(model.module.parameters())
    books = {k: [torch.zeros(p.numel(), dtype=torch.float64) for p in params] for k in ("local", "abs", "applied")}
    selected = []
    steps = 5
    for step in range(steps):
        x, y = _data(rank, step, device, dtype)
        local = torch.autograd.grad(_loss(model.module, x, y), params)
        model.zero_grad()
        _loss(model, x, y).backward()
        for i, (g, p) in enumerate(zip(local, params)):
            assert p.grad.device == device and p.grad.dtype == dtype
            mean, a = g.double().cpu().view(-1), g.double().abs().cpu().view(-1)
            dist.all_reduce(mean)
            dist.all_reduce(a)
            books["local"][i] += mean / world_size
            books["abs"][i] += a / world_size
            books["applied"][i] += p.grad.double().cpu().view(-1)
        stats = model.comm_stats()
        assert stats["host_syncs"] == 1 and stats["overflow"] == 0, stats
        selected.append(model._gf_engine.sync.last_selected.tolist())
    # Nothing lost: applied + mean_r(v) == sum_t mean_r(g), element by element.  Per step an
    # element is rounded when sent (fp16 wire, 2**-11 relative), in the wire's 2-term sum (again),
    # and when written back to a bf16 pool (2**-8); each error is at most that unit times a partial
    # sum of |g| <= A = sum_t mean_r |g|.  Bound: 3 * T * u * A, u the coarsest of those units.
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    v = model._gf_engine.sync.res.unscaled("v")
    held_any = False
    for i in range(len(params)):
        s = model.pool.layout.slots[i]
        held = v[s.pool][s.offset : s.offset + s.numel].double().cpu()
        dist.all_reduce(held)
        held /= world_size
        held_any = held_any or bool(held.abs().sum() > 0)
        err = (books["applied"][i] + held - books["local"][i]).abs()
        bound = 3 * steps * u * books["abs"][i]
        assert bool((err <= bound).all()), (i, float((err - bound).max()))
    assert held_any  # something was held back
    return selected


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize(
    "dtype,chunk_size,score",
    [
        (torch.float32, 64, "l1"),
        (torch.float32, 1024, "sampled_l1"),
        (torch.bfloat16, 1024, "l1"),
    ],
)
def test_csc_same_chunks_nothing_lost_one_host_read(kind: str, dtype: torch.dtype, chunk_size: int, score: str) -> None:
    r0, r1 = run_distributed(_csc_worker, 2, kind, dtype, chunk_size, score)
    assert r0 == r1 and all(r0)


def _scaler_worker(rank: int, world_size: int, kind: str) -> None:
    device = _device(kind, rank)
    # fp32 wire: scaled and unscaled values round alike (an fp16 wire would flush the unscaled
    # run's small gradients to subnormals, which is what loss scaling is for)
    kw = dict(device_ids=_ids(device), density=0.25, warmup_steps=0, chunk_size=64)
    plain, scaled = (gf.DistributedDataParallel(_net(device), **kw) for _ in range(2))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_factor=2.0, growth_interval=1)
    scaled.register_grad_scaler(scaler)
    opt = torch.optim.SGD(scaled.parameters(), lr=0.0)
    for step in range(4):
        x, y = _data(rank, step, device)
        for m in (plain, scaled):
            m.zero_grad()
        _loss(plain, x, y).backward()
        scaler.scale(_loss(scaled, x, y)).backward()
        scaler.unscale_(opt)
        for a, b in zip(plain.parameters(), scaled.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}"  # powers of two: unscale_ is exact
        for a, b in zip(plain._gf_engine.sync.res.unscaled("v"), scaled._gf_engine.sync.res.unscaled("v")):
            assert torch.equal(a, b), f"step {step}"
        scaler.step(opt)
        scaler.update()  # the scale doubles every step: the residual follows it
    assert scaler.get_scale() == 2.0**14


@pytest.mark.parametrize("kind", DEVICES)
def test_csc_follows_a_gradscalers_scale_on_the_device(kind: str) -> None:
    run_distributed(_scaler_worker, 2, kind)


def _quantized_worker(rank: int, world_size: int, kind: str) -> None:
    device = _device(kind, rank)
    model = gf.DistributedDataParallel(_net(device), device_ids=_ids(device), compression="quantized")
    params = list(model.module.parameters())
    local_sum = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    abs_sum = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    applied = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    steps = 4
    for step in range(steps):
        x, y = _data(rank, step, device)
        local = torch.autograd.grad(_loss(model.module, x, y), params)
        model.zero_grad()
        _loss(model, x, y).backward()
        for i, (g, p) in enumerate(zip(local, params)):
            assert p.grad.device == device
            got = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(got, p.grad)
            assert all(torch.equal(got[0], t) for t in got), f"step {step}: ranks differ"  # decoded the same bytes
            mean, a = g.double().cpu().view(-1), g.double().abs().cpu().view(-1)
            dist.all_reduce(mean)
            dist.all_reduce(a)
            local_sum[i] += mean / world_size
            abs_sum[i] += a / world_size
            applied[i] += p.grad.double().cpu().view(-1)
        assert model.comm_stats()["host_syncs"] == 0
    # Nothing lost: the ring sums contributions g/N + e, so applied + sum_r(e) == sum_t mean_r(g), up to
    # the fp32 adds of the contribution, the decoded sum and the error (each <= 2**-24 of a partial sum
    # of |g|, N of them per step): 3 T N u A.
    v = model._gf_engine.sync.res.v
    for i in range(len(params)):
        s = model.pool.layout.slots[i]
        held = v[s.pool][s.offset : s.offset + s.numel].double().cpu()
        dist.all_reduce(held)
        err = (applied[i] + held - local_sum[i]).abs()
        bound = 3 * steps * 2.0**-24 * abs_sum[i] * world_size
        assert bool((err <= bound + 1e-12).all()), (i, float((err - bound).max()))


@pytest.mark.parametrize("kind", DEVICES)
def test_quantized_identical_ranks_nothing_lost_no_host_reads(kind: str) -> None:
    """The AdamW recipe (3-bit ring, error feedback) on the device: the CPU kernel of comm/codec.c on CPU,
    torch ops on CUDA, the same contract."""
    run_distributed(_quantized_worker, 2, kind)


class _UsedInReverse(nn.Module):
    """Layers registered in the reverse of their use: backward's order is not the planned one, so the pool is
    re-laid out after step 0 and a two-level residual moves off its rank's shard."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.last = nn.Linear(48, 4)
        self.first = nn.Linear(64, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.first(x)))


def _two_level_worker(rank: int, world_size: int, kind: str) -> None:
    """Nodes of 2 ranks (torchrun's variables from the harness): dense two-level gives torch DDP's average
    within the fp32 summation tolerance (another order of the same N addends); the quantised recipe, CSC (fp16
    wire) and cscq leave every rank identical; all on the device (Gloo stages CUDA bytes through the host inside
    the node, a dense exchange between nodes on the host copy)."""
    device = _device(kind, rank)
    sparse = {
        name: gf.DistributedDataParallel(
            _net(device),
            device_ids=_ids(device),
            compression=c,
            fusion_threshold_mb=0.005,
            chunk_size=128,
            warmup_steps=0,
            dense_1d=False,
            **kw,
        )
        for name, c, kw in (("CSC", "none", {"comm_dtype": "fp16", "density": 0.25}), ("cscq", "cscq", {}))
    }
    ref = nn.parallel.DistributedDataParallel(_net(device), device_ids=_ids(device))
    dense = gf.DistributedDataParallel(_net(device), device_ids=_ids(device), fusion_threshold_mb=0.005)
    quant = gf.DistributedDataParallel(
        _UsedInReverse().to(device), device_ids=_ids(device), compression="quantized", fusion_threshold_mb=0.005
    )
    assert dense.config.topology == quant.config.topology == f"{world_size // 2}x2"
    params = list(quant.module.parameters())
    mean_sum = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    abs_sum = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    applied = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    steps = 3
    for step in range(steps):
        x, y = _data(rank, step, device)
        local = torch.autograd.grad(_loss(quant.module, x, y), params)
        for m in (ref, dense, quant, *sparse.values()):
            m.zero_grad()
            _loss(m, x, y).backward()
        for name, m in sparse.items():
            assert m.comm_stats()["selected_chunks"] > 0 and m.comm_stats()["inter_node_bytes"] > 0
            for p in m.parameters():
                got = [torch.empty_like(p.grad) for _ in range(world_size)]
                dist.all_gather(got, p.grad)
                assert all(torch.equal(got[0], t) for t in got), f"step {step}: {name}: ranks differ"
        for i, (g, p) in enumerate(zip(local, params)):
            mean, a = g.double().cpu().view(-1), g.double().abs().cpu().view(-1)
            dist.all_reduce(mean)
            dist.all_reduce(a)
            mean_sum[i] += mean / world_size
            abs_sum[i] += a / world_size
            applied[i] += p.grad.double().cpu().view(-1)
        for a, b in zip(ref.parameters(), dense.parameters()):
            assert b.grad.device == device
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)  # the order of the fp32 sum only
        for p in quant.parameters():
            got = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(got, p.grad)
            assert all(torch.equal(got[0], t) for t in got), f"step {step}: ranks differ"
        assert dense.comm_stats()["inter_node_bytes"] > 0 and quant.comm_stats()["inter_node_bytes"] > 0
    # Nothing lost across steps, through the pool's re-layout after step 0 (the residual then lies outside the
    # rank's shard and is folded into the next contribution): as the flat recipe's bound, 3 T N u A.
    res = quant._gf_engine.sync.res
    # and the residual holds only this rank's shard of each bucket (1/G of it), also after the re-layout:
    # its buffers are the plan's shards back to back, the padding past a bucket's end kept at zero
    from gradientflow.comm.topology import two_level_plan

    shards = 0
    for b in quant.pool.layout.buckets:
        plan = two_level_plan(b.numel, world_size // 2, 2, block=128)
        shard, m = res.shard(b)
        assert shard.numel() == plan.shard and shard.device == device, f"bucket {b.index}"
        assert shard[:m].any() and not shard[m:].any(), f"bucket {b.index}"
        shards += plan.shard
    assert sum(t.numel() for t in res.v) == shards
    v = res.expanded().v  # the pool's layout, zero off this rank's shards
    for i in range(len(params)):
        s = quant.pool.layout.slots[i]
        held = v[s.pool][s.offset : s.offset + s.numel].double().cpu()
        dist.all_reduce(held)
        err = (applied[i] + held - mean_sum[i]).abs()
        bound = 3 * steps * 2.0**-24 * abs_sum[i] * world_size
        assert bool((err <= bound + 1e-12).all()), (i, float((err - bound).max()))


@pytest.mark.parametrize("kind", DEVICES)
def test_two_level_on_the_device(kind: str) -> None:
    run_distributed(_two_level_worker, 4, kind, ranks_per_node=2, timeout=240)


@pytest.mark.parametrize("kind", DEVICES)
def test_auto_width_codec_is_timed_on_the_device(kind: str) -> None:
    """compression="auto"'s width choice times the 2-bit codec against the 3-bit one on the model's device (on
    CUDA the preconditioner's torch ops and the codec's kernels, synchronised): a finite, non-negative cost per
    gradient, far below the 1 ns a 1 Gbit/s link takes for the 0.125 B it saves on a GPU (0.23 ns the whole codec,
    docs/results/adamw.md), far below a microsecond anywhere.  On a GPU that holds at the engine's own sample
    (4M gradients, what it times for any model that large); a model of 256K gradients times mostly kernel launches
    (1.07 ns per gradient on an H200, 2026-11-28), and "auto" then weighs that cost as measured."""
    from gradientflow.policy import width

    extra = width.extra_seconds(_device(kind, 0), width.SAMPLE if kind == "cuda" else 1 << 18)
    assert 0.0 <= extra < (1e-9 if kind == "cuda" else 1e-6)
