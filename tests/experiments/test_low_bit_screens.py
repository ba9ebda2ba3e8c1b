"""experiments/quant_sim.py and experiments/fit_levels.py: the screen quantises as the library does, and the
fit finds the levels it says it finds."""

from __future__ import annotations

import fit_levels
import quant_sim
import torch

from gradientflow.comm.quantize import quantize, wire_bytes


def test_the_screen_quantises_as_the_library() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    for bits, zeroless, levels in ((2, True, "zeroless"), (2, False, "fitted"), (3, False, "fitted")):
        wire = torch.empty(wire_bytes(1000, bits, 128), dtype=torch.uint8)
        ref = quantize(x, wire, bits, 128, levels=levels)
        got = quant_sim.block_quantize(x, quant_sim.table(bits, zeroless), 128)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


def test_the_screen_parses_phases_and_groups() -> None:
    v = quant_sim.Variant("q3>pre-q2n@16", 0.9, ["a", "b"], [3, 2])
    assert [start for start, _ in v.phases] == [0, 16]
    assert v.phases[1][1][0][1].pre and v.phases[1][1][0][1].bits == 2 + 16 / 128
    v = quant_sim.Variant("q2n~b=q32", 0.9, ["a", "b"], [3, 2])
    (idx_a, _, _), (idx_b, exact, _) = v.phases[0][1]
    assert idx_a.tolist() == [0, 1, 2] and idx_b.tolist() == [3, 4] and exact.exact


def test_lloyd_max_finds_two_clusters() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.cat([0.2 + 0.01 * torch.randn(5000, generator=g), 0.7 + 0.01 * torch.randn(5000, generator=g)]).abs()
    mags = fit_levels.lloyd_max(a, 2, zero=False)
    torch.testing.assert_close(mags, torch.tensor([0.2, 0.7], dtype=torch.float64), rtol=0, atol=2e-3)
    # with a zero level and one magnitude: the upper cluster's centre (the lower one is nearer to 0 than to
    # any level that would also serve the upper one)
    (one,) = fit_levels.lloyd_max(a, 1, zero=True).tolist()
    assert abs(one - 0.7) < 2e-3


def test_the_sign_code_keeps_signs_at_the_blocks_mean_magnitude() -> None:
    # block of 4: mean |x| = (1 + 2 + 3 + 2) / 4 = 2; the last block holds 2 elements, mean (4 + 0) / 2 = 2
    x = torch.tensor([1.0, -2.0, 3.0, -2.0, -4.0, 0.0])
    torch.testing.assert_close(quant_sim.sign_quantize(x, 4), torch.tensor([2.0, -2.0, 2.0, -2.0, -2.0, 2.0]))


def test_the_screens_n_rank_exchange_loses_nothing() -> None:
    # from 3 ranks: contributions quantised with A (q1), each segment's sum with B (q3); every error stays in a
    # residual, so the residuals plus the result (the average) add up to the ranks' contributions
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(1000, generator=g) for _ in range(3)]
    v = quant_sim.Variant("q1/q3", 0.9, ["w"], [1000], nproc=3)
    v.sync([torch.zeros(1000)] * 3, 0)  # step 0 is dense, as in the library
    total = v.sync(grads, 1)
    contributions = sum(gr / 3 for gr in grads)
    torch.testing.assert_close(sum(v.err) + total, contributions, rtol=0, atol=1e-5)
    assert v.bits_sent == 32 * 1000 + (1 + 16 / 128 + 3 + 16 / 128) / 2 * 1000
