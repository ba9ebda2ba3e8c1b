"""compression="auto" with AdamW on two ranks: 3 bits or 2 ("q2npw20"), measured on the link and the device.

- the rule (strategies/width.py) by hand: 2-bit codes save 0.125 B a gradient; they pay where that takes longer
  on the link than their codec's extra time;
- the codec's extra time is a measurement (finite, >= 0, far below a microsecond a gradient);
- as user code on 2 ranks, the link's measurement replaced by a slow or a fast one (the one thing a test cannot
  shape on loopback): a slow link switches to "q2npw20" (comm_stats says so and why; 2-bit bytes after its
  20-step warm-up; ranks identical after every step), a fast one keeps 3 bits, and a resumed "auto" run continues
  on the checkpoint's width bit for bit without measuring again; a wrapper already switched to the other width
  refuses that checkpoint (ValueError).
"""

from __future__ import annotations

import io

import pytest
import torch
from _quant_training import batches, small_net

from gradientflow.strategies import width

from _dist import run_distributed

GBIT = 1e9 / 8  # bytes per second


def test_two_bits_pay_where_their_saved_bytes_take_longer_on_the_link_than_their_codec():
    # 3 bits: 128 * 3 / 8 = 48 B of codes a block, 2 bits: 32 B; the bf16 scale (2 B) is the same: 16 B / 128
    assert width.saved_bytes() == 0.125
    # 1 Gbit/s: 0.125 B take 1 ns; a CPU codec 2.5 ns slower (this project's CPU, docs/adamw.md) -> 3 bits
    assert not width.fewer_bits_pay(GBIT, 2.5e-9)
    # 200 Mbit/s: 5 ns > 2.5 ns -> 2 bits (both as measured: benchmarks/tta_adamw_q2)
    assert width.fewer_bits_pay(0.2 * GBIT, 2.5e-9)
    # a GPU's codec, ~0.05 ns slower, on a 10 Gbit/s link: 0.1 ns saved -> 2 bits
    assert width.fewer_bits_pay(10 * GBIT, 0.05e-9)
    assert not width.fewer_bits_pay(GBIT, 1.0e-9)  # equal: the bytes do not pay for the codec
    with pytest.raises(ValueError, match="link_Bps"):
        width.fewer_bits_pay(0.0, 1e-9)


def test_codec_extra_time_is_measured_per_gradient():
    extra = width.extra_seconds(torch.device("cpu"), 1 << 16)
    assert 0.0 <= extra < 1e-6  # ~2 ns here; a microsecond a gradient would be 1000x any measured codec


STEPS, WARMUP = 24, 20  # "q2npw20": its first 20 quantised steps at 3 bits, then 2


def _worker(rank: int, world: int, link_Bps: float) -> dict:
    from torch.nn import functional as F

    import gradientflow
    from gradientflow.engine.schedule import LinkEstimate
    from gradientflow.wrapper import auto

    measured = []

    def fake_link(*args: object) -> LinkEstimate:  # what engine.schedule.measure returns on that link
        measured.append(1)
        return LinkEstimate(alpha_s=1e-4, bulk_Bps=link_Bps)

    auto.measure_link = fake_link
    data = batches(rank, STEPS)

    def run(todo: list, resume: dict | None = None) -> tuple[dict, list, list, dict]:
        net = small_net()
        model = gradientflow.DistributedDataParallel(net, compression="auto")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if resume is not None:
            net.load_state_dict(resume["model"])
            opt.load_state_dict(resume["opt"])
            model.load_comm_state_dict(resume["comm"])
        history, sent = [], []
        for x, y in todo:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            history.append(torch.cat([p.detach().flatten() for p in net.parameters()]).tolist())
            sent.append(model.comm_stats()["payload_bytes"])  # this step's bytes
        buf = io.BytesIO()
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "comm": model.comm_state_dict()}, buf)
        buf.seek(0)
        return model.comm_stats(), history, sent, torch.load(buf, weights_only=True)

    stats, whole, sent, _ = run(data)
    _, head, _, ckpt = run(data[:5])
    before = len(measured)
    resumed_stats, tail, _, _ = run(data[5:], ckpt)
    measured_on_resume = len(measured) - before
    # a wrapper that already switched, on the other link, to the other width: loading this checkpoint is an error
    link_Bps = 1e12 if link_Bps < 1e9 else 1e5
    net = small_net()
    model = gradientflow.DistributedDataParallel(net, compression="auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in data[:2]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model(data[2][0])  # the forward that switches
    try:
        model.load_comm_state_dict(ckpt["comm"])
        other_width = "no error"
    except ValueError as exc:
        other_width = str(exc)
    return {
        "other_width": other_width,
        "compression": stats["compression"],
        "why": stats["compression_auto"],
        "resumed_why": resumed_stats["compression_auto"],
        "per_step": sent,  # comm_stats(): the last step's counters
        "history": whole,
        "resumed": head + tail,
        "measured_on_resume": measured_on_resume,
    }


def test_auto_sends_two_bits_on_a_slow_link_and_three_on_a_fast_one():
    n = 20 * 64 + 64 + 64 * 5 + 5  # small_net's 1669 parameters: one bucket of 14 blocks of 128
    # 0.8 Mbit/s: 1250 ns a gradient saved. The codec's extra time per gradient is timed on the model's 1669: its
    # fixed costs (a few calls, the floors' two means) over so few gradients are ~100 ns each here
    slow = run_distributed(_worker, 2, 1e5, timeout=240)
    for r in slow:
        assert r["compression"] == "q2npw20", r["why"]
        assert r["why"].startswith("AdamW -> q2npw20 (2 bits: 2-bit codes would save 1250.00 ns"), r["why"]
        # step 0 dense fp32 (auto has not seen the optimizer), then the whole gradient quantised, sent to the
        # one peer: 3 bits (14 x 48 B codes + 14 x 2 B scales) until the warm-up's 20 steps are done (they count
        # the run's steps, so step 0 is the first), then 2 bits (14 x 32 + 14 x 2)
        assert r["per_step"] == [4 * n] + [14 * 50] * (WARMUP - 1) + [14 * 34] * (STEPS - WARMUP)
        # the checkpoint's width, without measuring again
        assert r["measured_on_resume"] == 0 and r["resumed_why"].startswith("q2npw20"), r["resumed_why"]
        assert r["resumed"] == r["history"]  # bit for bit
        assert "sending 'q2npw20', this model switched to 'quantized' already" in r["other_width"], r["other_width"]
    assert slow[0]["history"] == slow[1]["history"]  # identical ranks after every step
    fast = run_distributed(_worker, 2, 100 * GBIT, timeout=240)
    for r in fast:
        assert r["compression"] == "quantized", r["why"]
        assert r["why"].startswith("AdamW -> quantized (3 bits"), r["why"]
        assert r["per_step"] == [4 * n] + [14 * 50] * (STEPS - 1)
        assert r["resumed"] == r["history"]
        assert "sending 'quantized', this model switched to 'q2npw20' already" in r["other_width"], r["other_width"]
