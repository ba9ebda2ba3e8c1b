"""compression="quantized" / "auto" (issue 27), written as user code where it can be.

- the block quantiser against a numpy re-implementation, and its byte count by hand;
- the quantised ring on 2, 3 and 4 ranks against the same ring simulated in numpy; ranks end
  identical; error mass conserved (sum of the ranks' errors + N x result == sum of the inputs);
- training: the recipe with the quantiser off ("q32") gives torch DDP's parameters; with 3 bits
  ranks hold identical parameters after every step; checkpoint + resume == uninterrupted run;
- options: a mismatch across ranks is a ValueError on every rank; conflicting keywords raise;
  "auto" picks cscq for SGD (with and without momentum), for Adam and AdamW quantized (two parties) or q3p
  (3 ranks: preconditioned), and ``comm_stats()`` says which.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from _quant_training import batches, small_net

from gradientflow.config import GradientFlowConfig

from _dist import run_distributed

BITS, BLOCK = 3, 128


# ---- the quantiser, in numpy ------------------------------------------------------------------
def _bf16(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16 (nearest, ties to even), returned as fp32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def np_quantize(x: np.ndarray, bits: int = BITS, block: int = BLOCK, uniform: bool = False) -> np.ndarray:
    """The decoded values of ``x`` (fp32): per block s = bf16(max|x|), u = x / s;
    - with a codebook (``CODEBOOKS``, 2 and 3 bits): the level of 0, ±l_1..±l_L nearest to u (a tie goes
      toward 0), decoded ±l_k s, l_k evaluated as the codec does (Horner in fp32 on its polynomial);
    - uniform: q = clip(round(u L), -L, L), decoded q s / L (numpy rounds half to even, as torch does)."""
    from gradientflow.comm.levels import CODEBOOKS
    from gradientflow.comm.levels import poly as _poly

    L = np.float32(2 ** (bits - 1) - 1)
    m = x.size
    nb = -(-m // block)
    rows = np.zeros(nb * block, np.float32)
    rows[:m] = x
    rows = rows.reshape(nb, block)
    s = _bf16(np.abs(rows).max(axis=1))
    if uniform or bits not in CODEBOOKS:
        step = s / L
        safe = np.where(step > 0, step, np.float32(1)).astype(np.float32)
        q = np.clip(np.round(rows / safe[:, None]), -L, L).astype(np.float32)
        return (q * step[:, None]).reshape(-1)[:m]
    safe = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    u = rows / safe[:, None]
    lv = (0.0, *CODEBOOKS[bits])
    k = sum((np.abs(u) > np.float32((a + b) / 2)).astype(np.float32) for a, b in zip(lv, lv[1:]))
    c = _poly(bits)
    level = k * np.float32(c[-1])
    for ci in reversed(c[:-1]):
        level = ((level + np.float32(ci)) * k).astype(np.float32)
    return (np.copysign(level, u) * s[:, None]).astype(np.float32).reshape(-1)[:m]


def np_ring(xs: list[np.ndarray], bits: int = BITS, block: int = BLOCK) -> tuple[np.ndarray, list[np.ndarray]]:
    """The quantised allreduce, simulated: segments of whole blocks, segment s owned by rank s; every other
    rank quantises its part of s, the owner adds the decoded parts to its own (in rank order) and quantises
    the sum once: what everyone decodes (two ranks: an exchange of whole contributions).
    Returns (result, errors)."""
    N, n = len(xs), xs[0].size
    if N == 2:  # one exchange of whole quantised contributions; each rank adds the two decoded ones
        decoded = [np_quantize(x, bits, block) for x in xs]
        return decoded[0] + decoded[1], [x - d for x, d in zip(xs, decoded)]
    nb = -(-n // block)
    q, rem = divmod(nb, N)
    bounds, start = [], 0
    for i in range(N):
        end = start + q + (i < rem)
        bounds.append((min(start * block, n), min(end * block, n)))
        start = end
    result = np.zeros(n, np.float32)
    errs = [np.zeros(n, np.float32) for _ in range(N)]
    for s, (a, b) in enumerate(bounds):
        if a == b:
            continue
        total = xs[s][a:b].copy()
        for r in range(N):
            if r != s:
                part = np_quantize(xs[r][a:b], bits, block)
                errs[r][a:b] = xs[r][a:b] - part
                total = (total + part).astype(np.float32)
        result[a:b] = np_quantize(total, bits, block)
        errs[s][a:b] = total - result[a:b]
    return result, errs


def test_quantiser_matches_numpy_and_counts_bytes():
    from gradientflow.comm.quantize import dequantize, quantize, wire_bytes

    g = torch.Generator().manual_seed(0)
    for m in (128, 1000, 5):
        x = torch.randn(m, generator=g) * 3
        out = torch.empty(wire_bytes(m, BITS, BLOCK), dtype=torch.uint8)
        err = torch.empty(m)
        decoded = quantize(x, out, BITS, BLOCK, err=err)
        assert torch.equal(dequantize(out, m, BITS, BLOCK), decoded)  # the receiver decodes what the sender kept
        np.testing.assert_allclose(decoded.numpy(), np_quantize(x.numpy()), rtol=1e-6, atol=0)
        assert torch.equal(err, x - decoded)
        # uniform levels ("q3u"): the first version of the recipe
        decoded = quantize(x, out, BITS, BLOCK, err=err, levels="uniform")
        assert torch.equal(dequantize(out, m, BITS, BLOCK, levels="uniform"), decoded)
        np.testing.assert_allclose(decoded.numpy(), np_quantize(x.numpy(), uniform=True), rtol=1e-6, atol=0)
    # By hand, 3-bit codebook levels 0, ±0.2, ±0.43, ±0.75 of the block max (midpoints 0.1, 0.315, 0.59):
    x = torch.zeros(128)
    x[:6] = torch.tensor(
        [2.0, -1.0, 0.7, 0.1, -0.2, 1.3]
    )  # max |x| = 2 (bf16-exact): x / 2 = 1, -.5, .35, .05, -.1 (a tie), .65
    out = torch.empty(wire_bytes(128, BITS, BLOCK), dtype=torch.uint8)
    got = quantize(x, out, BITS, BLOCK)[:6]
    torch.testing.assert_close(got, torch.tensor([1.5, -0.86, 0.86, 0.0, -0.0, 1.5]), rtol=1e-6, atol=0)
    # 2 bits: levels 0, ±0.46 (midpoint 0.23)
    out2 = torch.empty(wire_bytes(128, 2, BLOCK), dtype=torch.uint8)
    torch.testing.assert_close(quantize(x, out2, 2, BLOCK)[:6], torch.tensor([0.92, -0.92, 0.92, 0.0, -0.0, 0.92]))
    # Subnormal blocks (a step whose reciprocal overflows) and all-zero blocks decode finite.
    tiny = torch.cat([torch.full((128,), 1e-40), torch.zeros(128)])
    out = torch.empty(wire_bytes(256, BITS, BLOCK), dtype=torch.uint8)
    assert torch.isfinite(quantize(tiny, out, BITS, BLOCK)).all()
    # By hand: 3 bits per element + one bf16 scale per 128 elements = 3/8 + 2/128 bytes; fp32 is 4.
    assert wire_bytes(128 * 1000, BITS, BLOCK) / (4 * 128 * 1000) == pytest.approx((3 / 8 + 2 / 128) / 4)
    assert (3 / 8 + 2 / 128) / 4 == pytest.approx(0.09765625)


# ---- the ring on 2, 3, 4 ranks ----------------------------------------------------------------
def _ring_worker(rank: int, world: int, sizes: list[int]) -> list[tuple[list[float], list[float], list[float]]]:
    import torch.distributed as dist

    from gradientflow.comm.quantized_ring import QuantizedRing

    out = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * n + rank)) * (rank + 1)
        x0 = x.clone()
        err = torch.full((n,), float("nan"))  # every element must be written
        ring = QuantizedRing(x, err, dist.group.WORLD, bits=BITS, block=BLOCK)
        ring.wait()
        out.append((x0.tolist(), x.tolist(), err.tolist()))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_numpy_reference_and_conserves_error_mass(world):
    sizes = [1000, 5, 128 * 7 + 3]  # several blocks per rank; fewer blocks than ranks; a short last block
    per_rank = run_distributed(_ring_worker, world, sizes)
    for k in range(len(sizes)):
        xs = [np.array(r[k][0], np.float32) for r in per_rank]
        results = [np.array(r[k][1], np.float32) for r in per_rank]
        errs = [np.array(r[k][2], np.float32) for r in per_rank]
        for res in results[1:]:
            np.testing.assert_array_equal(res, results[0])  # identical bytes decoded identically
        ref, ref_errs = np_ring(xs)
        scale = np.abs(sum(xs)).max()
        # numpy and torch may round the adds of a partial differently in the last bit; that moves no
        # code except at an exact tie, so equality up to a few fp32 ulps of the sum's magnitude.
        np.testing.assert_allclose(results[0], ref, rtol=0, atol=4e-6 * scale)
        for e, re in zip(errs, ref_errs):
            np.testing.assert_allclose(e, re, rtol=0, atol=4e-6 * scale)
        # Error mass: the errors telescope, sum_r err_r + result == sum_r x_r, up to the fp32
        # rounding of the N-1 adds of each partial (each <= half an ulp of the partial).
        mass = sum(e.astype(np.float64) for e in errs) + results[0] - sum(x.astype(np.float64) for x in xs)
        assert np.abs(mass).max() <= world * 2**-23 * scale


# ---- training, as a user writes it ------------------------------------------------------------
_net, _batches = small_net, batches  # shared with the other quantised-recipe tests (tests/_quant_training.py)


def _train(model, opt, batches, after_step=None):
    from torch.nn import functional as F

    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step()


def _params(net) -> list[float]:
    return torch.cat([p.detach().flatten() for p in net.parameters()]).tolist()


def _training_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradientflow

    steps = 6
    batches = _batches(rank, steps)
    out: dict = {}

    # 1. Quantiser off ("q32"): the same ring and error feedback, fp32 on the wire -> torch DDP.
    for name, wrap in (
        ("torch", lambda n: TorchDDP(n)),
        ("q32", lambda n: gradientflow.DistributedDataParallel(n, compression="q32")),
    ):
        net = _net()
        model = wrap(net)
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches)
        out[name] = _params(net)

    # 2. 3 bits: identical parameters on every rank after every step.
    net = _net()
    model = gradientflow.DistributedDataParallel(net, compression="quantized")
    history: list[list[float]] = []
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches, lambda: history.append(_params(net)))
    out["q3_history"] = history
    stats = model.comm_stats()
    out["q3_bytes"] = (stats["payload_bytes"], stats["dense_bytes"], stats["compression"])

    # 3. Checkpoint at step k and resume == uninterrupted (auto + AdamW: dense step 0, then quantised; auto + SGD
    # momentum: dense step 0, then "cscq"). k = 1: saved before the switch, so the resumed run's recipe must start its
    # ramp (CSC's density, the quantiser's 3-bit warm-up) at the run's step 1, not at the fresh wrapper's 0
    def run(stop: int | None, resume: dict | None, sgd: bool = False) -> tuple[list[float], dict | None]:
        net = _net()
        model = gradientflow.DistributedDataParallel(net, compression="auto")
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if sgd
            else torch.optim.AdamW(model.parameters(), lr=1e-2)
        )
        todo = batches
        if resume is not None:
            net.load_state_dict(resume["model"])
            opt.load_state_dict(resume["opt"])
            model.load_comm_state_dict(resume["comm"])
            todo = batches[resume["at"] :]
        elif stop is not None:
            todo = batches[:stop]
        _train(model, opt, todo)
        if stop is None:
            return _params(net), None
        buf = io.BytesIO()
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "comm": model.comm_state_dict()}, buf)
        buf.seek(0)
        return _params(net), {**torch.load(buf, weights_only=True), "at": stop}

    out["resume"] = []
    for sgd in (False, True):
        whole, _ = run(None, None, sgd)
        for k in (1, 3):
            _, ckpt = run(k, None, sgd)
            resumed, _ = run(None, ckpt, sgd)
            out["resume"].append(resumed == whole)

    # 4. auto: the recipe by optimizer class, agreed, named in comm_stats().
    picks = {}
    for label, make in (
        ("SGD", lambda p: torch.optim.SGD(p, lr=0.1)),
        ("SGD momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("Adam", lambda p: torch.optim.Adam(p, lr=1e-3)),
        ("AdamW", lambda p: torch.optim.AdamW(p, lr=1e-3)),
    ):
        model = gradientflow.DistributedDataParallel(_net(), compression="auto")
        _train(model, make(model.parameters()), batches[:2])
        s = model.comm_stats()
        picks[label] = (s["compression"], s["compression_auto"])

    out["picks"] = picks
    dist.barrier()
    return out


def test_training_full_precision_identical_ranks_resume_and_auto_picks():
    per_rank = run_distributed(_training_worker, 3)
    for r in per_rank:
        # Quantiser off: only the order of the fp32 additions differs from torch DDP's allreduce
        # (<= 2 ulp per averaged gradient with 3 ranks); six AdamW steps at lr 1e-2 move each
        # parameter by <= 6e-2, normalised by Adam, so the difference stays within 1e-6.
        np.testing.assert_allclose(r["q32"], r["torch"], rtol=0, atol=1e-6)
        assert r["resume"] == [True] * 4  # AdamW, SGD: checkpoint after steps 1 and 3, resumed: bit for bit
    for step in range(6):
        assert per_rank[1]["q3_history"][step] == per_rank[0]["q3_history"][step]
        assert per_rank[2]["q3_history"][step] == per_rank[0]["q3_history"][step]
    payload, dense, name = per_rank[0]["q3_bytes"]
    assert name == "3bit"
    assert payload / dense < 0.11  # 0.0977 plus each bucket's short last block
    assert per_rank[0]["picks"] == {
        "SGD": ("topk-3bit", "SGD -> topk-3bit"),
        "SGD momentum": ("topk-3bit", "SGD -> topk-3bit"),
        # 3 ranks: each segment's sum is quantised again, so Adam-type optimizers get the preconditioned 3 bits
        "Adam": ("3bit-precond", "Adam -> 3bit-precond (3 bits, preconditioned: 3 parties)"),
        "AdamW": ("3bit-precond", "AdamW -> 3bit-precond (3 bits, preconditioned: 3 parties)"),
    }


# ---- options ----------------------------------------------------------------------------------
def _mismatch_worker(rank: int, world: int) -> list[str]:
    from torch.nn import functional as F

    import gradientflow

    messages = []
    try:  # an option that differs between ranks
        gradientflow.DistributedDataParallel(_net(), compression="quantized" if rank == 0 else "q4")
        messages.append("no error")
    except ValueError as exc:
        messages.append(str(exc))
    try:  # auto, but the ranks step different optimizer classes
        model = gradientflow.DistributedDataParallel(_net(), compression="auto")
        opt = torch.optim.AdamW(model.parameters()) if rank == 0 else torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(rank, 2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        messages.append("no error")
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_mismatch_across_ranks_is_a_value_error_on_every_rank():
    for option, auto in run_distributed(_mismatch_worker, 2):
        assert "different options: compression" in option or "different options: quant_bits" in option, option
        assert "different recipes" in auto, auto


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"compression": "csc", "comm_dtype": "bf16"}, "comm_dtype='fp16' by its name"),
        ({"compression": "3bit", "density": 0.3}, "sends every coordinate"),
        ({"compression": "quantized", "comm_dtype": "fp16"}, "comm_dtype"),
        ({"compression": "auto", "density": 0.1}, "density"),
        ({"compression": "q9"}, "compression must be"),
        ({"compression": "q3b100"}, "quant_block a multiple of 16"),
        ({"compression": "3bit", "quant_block": 100}, "quant_block a multiple of 16"),
    ],
)
def test_conflicting_or_unknown_compression_raises(kwargs, says):
    with pytest.raises(ValueError, match=says):
        GradientFlowConfig(**kwargs)


def test_named_recipes_set_todays_keywords():
    assert (GradientFlowConfig(compression="csc").comm_dtype, GradientFlowConfig(compression="csc").density) == (
        "fp16",
        0.1,
    )
    assert GradientFlowConfig(compression="fp16").wire_dtype == torch.float16
    q = GradientFlowConfig(compression="q4b64")
    assert (q.compression, q.quant_bits, q.quant_block) == ("4bit", 4, 64)
    assert GradientFlowConfig().compression == "none" and not GradientFlowConfig().quantized
    # "quantized" = "q3": non-uniform levels; a "u" asks for uniform ones (the first version of the recipe)
    d, u = GradientFlowConfig(compression="quantized"), GradientFlowConfig(compression="q3u")
    assert (d.quant_bits, d.quant_block, d.quant_levels) == (3, 128, "fitted")
    assert (u.compression, u.quant_bits, u.quant_block, u.quant_levels) == ("3bit", 3, 128, "uniform")
    assert GradientFlowConfig(compression="q2b64uc2").quant_levels == "uniform"


def _theta_worker(rank: int, world: int) -> dict:
    import gradientflow
    from gradientflow.option_values import QUANT_THETA_MB

    out = {}
    for label, kw in (
        ("quantized", {"compression": "quantized"}),
        ("quantized, bucket_cap_mb=25", {"compression": "quantized", "bucket_cap_mb": 25}),
        ("quantized, fusion_threshold_mb=2", {"compression": "quantized", "fusion_threshold_mb": 2}),
        ("csc", {"compression": "csc"}),
    ):
        out[label] = gradientflow.DistributedDataParallel(_net(), **kw).config.fusion_threshold_mb
    # auto: dense (θ 25) until AdamW steps, then the quantised recipe with its θ (the user gave none)
    model = gradientflow.DistributedDataParallel(_net(), compression="auto")
    before = model.config.fusion_threshold_mb
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _batches(rank, 2))
    out["auto + AdamW"] = (before, model.config.fusion_threshold_mb, model.comm_stats()["compression"])
    out["expected"] = QUANT_THETA_MB
    return out


def test_quantized_recipe_default_theta_unless_the_user_gives_one():
    """The quantised recipe's own θ (config.QUANT_THETA_MB, 8 MB) where neither bucket_cap_mb nor
    fusion_threshold_mb is given; a θ the user gives is kept; other recipes keep 25 MB."""
    r = run_distributed(_theta_worker, 2)[0]
    assert r["expected"] == 8.0
    assert r["quantized"] == 8.0
    assert r["quantized, bucket_cap_mb=25"] == 25.0
    assert r["quantized, fusion_threshold_mb=2"] == 2.0
    assert r["csc"] == 25.0
    assert r["auto + AdamW"] == (25.0, 8.0, "2bit-precond")
