"""``compression="topk-3bit"``: the top-k chunks travel as 3-bit blocks, the error left in the residual.

Specified as a user sees it: the options the name sets, ranks that agree after every step, the bytes of every
step derived by hand, nothing lost (what a step did not deliver is in v), and an exact resume.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import pytest
import torch
import torch.distributed as dist
from test_csc import CHUNK, _batch, _mlp, _param_view, _residual, _run
from torch import nn

import gradientflow as gf
from gradientflow.comm.quantize import wire_bytes
from gradientflow.config import GradientFlowConfig
from gradientflow.strategies import csc_quantized

from _dist import run_distributed

EPS32 = torch.finfo(torch.float32).eps


def test_topk_3bit_is_density_0_3_on_fp32_rows_unless_a_density_is_passed_and_refuses_a_conflicting_wire() -> None:
    cfg = GradientFlowConfig(compression="topk-3bit")
    assert (cfg.compression, cfg.density, cfg.comm_dtype, cfg.quant_bits, cfg.quant_block) == (
        "topk-3bit",
        0.3,
        "fp32",
        3,
        128,
    )
    assert cfg.sparse and not cfg.quantized  # the top-k strategy, its chunks quantised
    assert GradientFlowConfig(compression="cscq") == cfg  # its earlier name, still accepted
    with pytest.raises(ValueError, match="compression='topk-3bit' puts its own codes on the wire"):
        GradientFlowConfig(compression="topk-3bit", comm_dtype="fp16")
    # a density passed beside it overrides the recipe's (docs/recipes.md, the rule)
    denser = GradientFlowConfig(compression="topk-3bit", density=0.5)
    assert (denser.compression, denser.density, denser.comm_dtype, denser.quant_bits) == ("topk-3bit", 0.5, "fp32", 3)
    assert dataclasses.replace(denser) == denser  # resolving again keeps it (a resumed or rebuilt config)
    with pytest.raises(ValueError, match="density must be None"):
        GradientFlowConfig(compression="topk-3bit", density=1.5)


def test_auto_gives_topk_3bit_half_the_chunks_beyond_a_pair_of_ranks() -> None:
    """More than two parties quantise the chunks twice (a ring's reduce-scatter and its sum, or the node sums); a pair
    once: "auto" sends 0.5 of the chunks there (measured 1.015x / 1.019x DDP's loss at 4 ranks where 0.3 ended 1.021x
    / 1.027x), 0.3 on two ranks.  Nothing for the other recipes, nor for "topk-3bit" passed by name (the wrapper
    only)."""
    from gradientflow.policy.auto_choice import recipe_options

    assert recipe_options("topk-3bit", 2) == {}
    assert (
        recipe_options("topk-3bit", 3)
        == recipe_options("topk-3bit", 4)
        == recipe_options("topk-3bit", 6)
        == {"density": 0.5}
    )
    assert recipe_options("3bit", 4) == recipe_options("topk-fp16", 4) == {}


def test_topk_3bit_and_auto_chunks_hold_whole_quantiser_blocks() -> None:
    """chunk_size="auto" gives the quality bench's digits CNN (188,234 gradients) 2 ** floor(log2(188234 // 2000)) = 64
    under "topk-fp16"; "topk-3bit" (and "auto", which may pick it) floor it at the 128-gradient block: the rows are
    encoded straight, and the fp32 scores cost 4 / (128 x 4) of DDP's bytes instead of 4 / (64 x 4).  Large models
    keep the paper's 32768; a chunk the user passes is kept."""
    cpu = torch.device("cpu")
    assert GradientFlowConfig(compression="topk-fp16").resolved(188_234, cpu).chunk_size == 64
    assert GradientFlowConfig(compression="topk-3bit").resolved(188_234, cpu).chunk_size == 128
    assert GradientFlowConfig(compression="auto").resolved(188_234, cpu).chunk_size == 128
    assert GradientFlowConfig(compression="topk-3bit").resolved(431_463, cpu).chunk_size == 128  # the LM: 128 already
    assert GradientFlowConfig(compression="topk-3bit").resolved(25_557_032, cpu).chunk_size == 32768
    assert GradientFlowConfig(compression="topk-3bit", chunk_size=64).resolved(188_234, cpu).chunk_size == 64


def _model(chunk: int = CHUNK, **kw) -> gf.DistributedDataParallel:
    # θ = 1 KB: several buckets; global scope: one slice (one top-k) for the one pool buffer, so the bytes are
    # one quantised message; no ramp and no 1-D rule unless asked: the selection is density's alone.
    opts = dict(fusion_threshold_mb=0.001, chunk_size=chunk, dense_1d=False, warmup_steps=0, csc_scope="global")
    opts.update(kw)
    return gf.DistributedDataParallel(_mlp(), compression="topk-3bit", **opts)


def _flat(model: gf.DistributedDataParallel, tensors: list[torch.Tensor]) -> torch.Tensor:
    params = list(model.module.parameters())
    return torch.cat([_param_view(model, tensors, i).reshape(-1) for i in range(len(params))])


def _steps_worker(rank: int, world_size: int, steps: int, chunk: int) -> list[list[list[float]]]:
    gen = torch.Generator().manual_seed(30 + rank)
    model = _model(chunk)
    sync = model._gf_engine.sync
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.module.parameters())
    snapshots = []
    v_before: torch.Tensor | None = None  # v after the last step (None: no sparse step yet, v is 0)
    for step in range(steps):
        x, y = _batch(gen)
        local = torch.autograd.grad(nn.functional.cross_entropy(model.module(x), y), params)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        st = model.comm_stats()
        g = torch.cat([t.reshape(-1) for t in local])
        if True:  # warmup_steps=0: every step sparse, from the first
            # The bytes: fp32 scores of every chunk, then one quantised copy of the selected rows (whole chunks)
            n, k = st["n_chunks"], st["selected_chunks"]
            assert k == -(-3 * n // 10)  # ceil(0.3 n): one slice
            assert st["payload_bytes"] == 4 * n + wire_bytes(k * chunk, 3, 128), st
            # Nothing lost: sum_r v_r(after) + N * average == sum_r (v_r(before) + g_r), elementwise.  Every value
            # on the way (a row, its decoded codes, their error, a partial sum) is at most N * m in magnitude, m the
            # largest |v + g| of any rank; at most 4 fp32 roundings (v + g, x - decoded, the decoded sum, / N), each
            # <= eps / 2 of N * m: 2 * N * eps * m.  A dropped error would be a quantisation step (~m / 8).
            v_after = _flat(model, _residual(model, "v"))
            avg = torch.cat([p.grad.reshape(-1) for p in params])
            before = (g if v_before is None else v_before + g).double()
            m = before.abs().max().clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
            lhs, rhs = v_after.double().clone(), before.clone()
            dist.all_reduce(lhs)
            dist.all_reduce(rhs)
            lhs += world_size * avg.double()
            assert float((lhs - rhs).abs().max()) <= 2 * world_size * EPS32 * float(m), step
            # the sent rows really were quantised: their error is in v ("topk-fp16" leaves 0 there)
            sent = sync.last_selected
            rows = v_after.new_zeros(n * chunk)
            rows[: v_after.numel()] = v_after
            assert rows.view(n, chunk)[sent].abs().sum() > 0
            v_before = v_after
        snapshots.append([p.detach().reshape(-1).tolist() for p in params])  # plain lists cross the queue
        opt.step()
    return snapshots


@pytest.mark.parametrize(("world_size", "chunk"), [(2, CHUNK), (2, 128), (3, 128)])
def test_ranks_agree_every_step_bytes_by_hand_and_nothing_lost(world_size: int, chunk: int) -> None:
    """2 ranks: one exchange of each rank's quantised rows (chunks of whole 128-blocks: straight from v's rows and
    into the pool's; 64: packed first); 3: the direct reduce-scatter and the sum's allgather."""
    results = run_distributed(_steps_worker, world_size, 6, chunk, timeout=120)
    for other in results[1:]:
        assert other == results[0]  # bit for bit: the same floats


def _resume_worker(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(40 + rank)
    batches = [_batch(gen) for _ in range(7)]
    kw = dict(warmup_steps=2, momentum=0.9)  # the ramp and momentum correction's u across the checkpoint
    ref = _model(**kw)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _run(ref, ref_opt, batches)

    first = _model(**kw)
    first_opt = torch.optim.SGD(first.parameters(), lr=0.1)
    _run(first, first_opt, batches[:3])
    ckpt = copy.deepcopy({"opt": first_opt.state_dict(), "comm": first.comm_state_dict()})
    params = [p.detach().clone() for p in first.module.parameters()]
    assert ckpt["comm"]["compression"] == "topk-3bit" and ckpt["comm"]["step"] == 3

    plain_topk = gf.DistributedDataParallel(_mlp(), compression="topk-fp16", chunk_size=CHUNK)
    with pytest.raises(ValueError, match="saved with compression='topk-3bit'"):
        plain_topk.load_comm_state_dict(ckpt["comm"])  # the same residual, another wire: refused, not guessed

    second = _model(**kw)
    with torch.no_grad():
        for p, saved in zip(second.module.parameters(), params):
            p.copy_(saved)
    second_opt = torch.optim.SGD(second.parameters(), lr=0.1)
    second_opt.load_state_dict(ckpt["opt"])
    second.load_comm_state_dict(ckpt["comm"])
    _run(second, second_opt, batches[3:])
    for a, b in zip(ref.module.parameters(), second.module.parameters()):
        assert torch.equal(a, b)


def test_comm_state_dict_resume_is_bit_identical_and_another_recipe_is_refused() -> None:
    run_distributed(_resume_worker, 2, timeout=120)


def _overflow_worker(rank: int, world_size: int, chunk: int) -> dict:
    """An inf in one rank's gradient (a loss scale too high): every rank skips that step, as with "topk-fp16"."""
    gen = torch.Generator().manual_seed(50 + rank)
    x, y = _batch(gen, 64)
    model = _model(chunk, momentum=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    model.register_grad_scaler(scaler)
    sync = model._gf_engine.sync
    losses, skipped = [], []
    params = list(model.module.parameters())
    for step in range(30):
        if step == 5:  # what v must hold after the skipped step on the rank without the inf: all it had, plus g
            local = torch.autograd.grad(nn.functional.cross_entropy(model.module(x), y), params)
            kept = _flat(model, _residual(model, "v")) + torch.cat([g.reshape(-1) for g in local])
        hook = None
        if step == 5 and rank == 0:
            first = next(model.module.parameters())
            hook = first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if all(torch.equal(a, p) for a, p in zip(before, model.parameters())):
            skipped.append(step)
        for r in sync.res.buffers():  # the quantiser's NaN error never stays in the residual
            assert bool(torch.isfinite(r).all()), f"non-finite residual at step {step}"
        if step == 5 and rank == 1:  # nothing lost: error + decoded value = the value sent, up to one rounding
            v = _flat(model, _residual(model, "v"))
            assert float((v - kept).abs().max()) <= 4 * EPS32 * float(kept.abs().max()), step
        losses.append(loss.item())
    return {"skipped": skipped, "losses": losses}


@pytest.mark.parametrize("chunk", [CHUNK, 128])  # packed; straight from v (whose sent rows get their value back)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank_and_training_goes_on(chunk: int) -> None:
    r0, r1 = run_distributed(_overflow_worker, 2, chunk, timeout=120)
    assert r0["skipped"] == r1["skipped"] == [5], r0["skipped"]
    losses = r0["losses"]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[6:11]) / 5, losses  # the loss keeps falling after the skip


def _straight_worker(rank: int, world_size: int) -> None:
    """Encoding v's rows straight (error over them) and decoding into the pool's rows, against packing them first:
    the same floats, step after step (the codes, scales and errors are computed block by block either way; the
    average is (a + b) * 0.5 against (a + b) / 2, both exact halvings)."""
    gen = torch.Generator().manual_seed(60 + rank)
    straight, packed = _model(128, momentum=0.9), _model(128, momentum=0.9)
    packed._gf_engine.sync.chunks._straight = lambda *args: False
    calls = [0]
    rows_kernel = csc_quantized.codec_native.quantize_rows

    def counted(*args, **kw):
        calls[0] += 1
        rows_kernel(*args, **kw)

    csc_quantized.codec_native.quantize_rows = counted
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (straight, packed)]
    for _ in range(6):
        x, y = _batch(gen)
        for m, o in zip((straight, packed), opts):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        assert calls[0] > 0  # the straight model took the kernel's rows path (the packed one never does)
        calls[0] = 0
        for a, b in zip(straight.module.parameters(), packed.module.parameters()):
            assert torch.equal(a, b)
        for a, b in zip(
            _residual(straight, "v") + _residual(straight, "u"), _residual(packed, "v") + _residual(packed, "u")
        ):
            assert torch.equal(a, b)


def test_rows_encoded_straight_from_v_equal_the_packed_path_bit_for_bit() -> None:
    from gradientflow.comm import codec_native

    if codec_native.library() is None:
        pytest.skip("no C compiler here: both ranks pack (the torch ops)")
    run_distributed(_straight_worker, 2, timeout=120)


class _Wide(nn.Module):
    """Linear(512, 2048) -> tanh -> Linear(2048, 3072): 7.3M parameters (29 MB), the output layer registered first so
    the first step re-lays the pool in backward order (as ResNet-50's does in the bench)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(2048, 3072)
        self.hidden = nn.Linear(512, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _memory_worker(rank: int, world_size: int, compression: str) -> float:
    """The most resident memory a rank adds over 4 steps (read after every backward and optimizer step), MB."""
    torch.manual_seed(0)
    module, gen = _Wide(), torch.Generator().manual_seed(rank)
    base = _rss_mb()
    model = gf.DistributedDataParallel(module, compression=compression, chunk_size=4096, warmup_steps=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    top = 0.0
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 512, generator=gen)).square().mean().backward()
        top = max(top, _rss_mb() - base)
        opt.step()
        top = max(top, _rss_mb() - base)
    return top


def test_topk_3bit_holds_no_more_memory_than_topk_fp16_across_the_first_steps_re_layout() -> None:
    """The first step re-lays the pool and v in backward order; the rows "topk-3bit" decoded into are views of the old
    ones and must be let go with the step, else the old pool and v stay alive a step longer: 2 x 29 MB more at the
    peak than "topk-fp16"'s (measured before the fix: ResNet-50's +707 MB against its +500).  Both hold the same buffers
    (pool, v, momentum; the wires' scratch is under 2 MB here), so a margin of one model size (29 MB) separates
    an RSS reading's noise from the two buffers held."""
    from gradientflow.comm import codec_native

    if codec_native.library() is None:
        pytest.skip("no C compiler here: the rows are packed, nothing of the pool is held")
    fp16 = max(run_distributed(_memory_worker, 2, "topk-fp16", timeout=120))
    three_bit = max(run_distributed(_memory_worker, 2, "topk-3bit", timeout=120))
    assert three_bit < fp16 + 29, (three_bit, fp16)


def _accumulate_worker(rank: int, world_size: int) -> list[list[float]]:
    """Gradient accumulation as users write it: two micro-batches under ``no_sync()``, the third synchronised."""
    gen = torch.Generator().manual_seed(70 + rank)
    model = _model(128, momentum=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for _ in range(4):
        opt.zero_grad()
        with model.no_sync():
            for _ in range(2):
                x, y = _batch(gen)
                nn.functional.cross_entropy(model(x), y).backward()
        x, y = _batch(gen)
        nn.functional.cross_entropy(model(x), y).backward()
        assert model.comm_stats()["selected_chunks"] > 0
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
    return out


def test_no_sync_accumulation_trains_identical_ranks() -> None:
    r0, r1 = run_distributed(_accumulate_worker, 2, timeout=120)
    assert r0 == r1
    assert r0[0] != r0[-1]  # it trained


def test_adamw_under_topk_3bit_is_warned_at_its_first_step() -> None:
    """A user who passes "topk-3bit" with AdamW hears, at the first step, what it measured and what to pass instead."""
    run_distributed(_adamw_warning_worker, 1, timeout=60)


def _adamw_warning_worker(rank: int, world_size: int) -> None:
    import warnings

    model = gf.DistributedDataParallel(_mlp(), compression="topk-3bit", chunk_size=CHUNK)
    opt = torch.optim.AdamW(model.parameters())
    x, y = _batch(torch.Generator().manual_seed(0))
    nn.functional.cross_entropy(model(x), y).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("compression='topk-3bit'" in str(w.message) and "compression='auto'" in str(w.message) for w in caught)


class _Deep(nn.Module):
    """Four Linear layers of different widths: with θ = 1 KB and per-slice selection, a step sends several slices of
    different sizes, each its own quantised exchange."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 5)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _slow_rank_worker(rank: int, world_size: int) -> list[list[float]]:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(
        _Deep(), compression="topk-3bit", fusion_threshold_mb=0.001, chunk_size=128, dense_1d=False, warmup_steps=0
    )
    if rank == 0:  # rank 0 dawdles between two slices of its backward: its earlier exchange's messages all arrive
        model.module.layers[4].register_full_backward_hook(lambda *_: time.sleep(0.05))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(30 + rank)
    for _ in range(4):
        x, y = _batch(gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert len(model._gf_engine.sync.last_slice_sizes) >= 3  # several slices: several exchanges in one step
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.module.parameters()]


@pytest.mark.parametrize("world_size", [3, 4])
def test_several_slices_from_three_ranks_with_one_rank_late_stay_in_step(world_size: int) -> None:
    """From 3 ranks each slice's exchange has two rounds, the second posted when the first has arrived: a rank that
    is late sees its earlier exchange's first round complete before it starts the next slice's, the others do not.
    Every rank must still post its messages in the same order (one exchange at a time, in slice order), else a
    peer's message lands in another exchange's receive (Gloo: "Received data size doesn't match"; found on ResNet-50
    at 4 ranks).  The ranks end with the same parameters, bit for bit."""
    results = run_distributed(_slow_rank_worker, world_size, timeout=120)
    for other in results[1:]:
        assert other == results[0]
