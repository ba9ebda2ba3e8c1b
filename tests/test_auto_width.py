"""compression="auto" with AdamW on two ranks: 3 bits or 2 ("q2npw20"), measured on the link and the device.

- the rule (strategies/width.py) by hand: 2-bit codes save 0.125 B a gradient; they pay where that takes longer
  on the link than their codec's extra time;
- the codec's extra time is a measurement (finite, >= 0, far below a microsecond a gradient);
- the rule counts the wire time saved only up to what the 3-bit steps left exposed;
- as user code on 2 ranks, the link's measurement and the steps' exposed communication replaced (what a test
  cannot shape on loopback): a slow link that held the 3-bit steps back goes on at 2 bits after "q2npw20"'s
  20-step 3-bit warm-up (comm_stats says so and why; every step's bytes; ranks identical after every step); a
  fast link, or a slow one whose bytes went while backward ran, keeps 3 bits; a run resumed before the switch
  or inside the warm-up decides at its end and one resumed after it keeps the checkpoint's width without
  measuring, both bit for bit; a wrapper that decided the other width refuses that checkpoint (ValueError).
"""

from __future__ import annotations

import io

import pytest
import torch
from _quant_training import batches, small_net

from gradientflow.policy import width

from _dist import run_distributed

GBIT = 1e9 / 8  # bytes per second


def test_two_bits_pay_where_their_saved_bytes_take_longer_on_the_link_than_their_codec():
    # 3 bits: 128 * 3 / 8 = 48 B of codes a block, 2 bits: 32 B; the bf16 scale (2 B) is the same: 16 B / 128
    assert width.saved_bytes() == 0.125
    # 1 Gbit/s: 0.125 B take 1 ns; a CPU codec 2.5 ns slower (this project's CPU, docs/results/adamw.md) -> 3 bits
    assert not width.fewer_bits_pay(GBIT, 2.5e-9)
    # 200 Mbit/s: 5 ns > 2.5 ns -> 2 bits (both as measured: benchmarks/tta_adamw_2bit_precond)
    assert width.fewer_bits_pay(0.2 * GBIT, 2.5e-9)
    # ... unless the 3-bit step waited less on the link than the codec costs: 1.7 ns exposed < 2.5 ns -> 3 bits
    assert not width.fewer_bits_pay(0.2 * GBIT, 2.5e-9, exposed_s=1.7e-9)
    assert width.fewer_bits_pay(0.2 * GBIT, 2.5e-9, exposed_s=3e-9)  # 3 ns of the 5 exposed: pays
    assert not width.fewer_bits_pay(0.2 * GBIT, 2.5e-9, exposed_s=0.0)
    # a GPU's codec, ~0.05 ns slower, on a 10 Gbit/s link: 0.1 ns saved -> 2 bits
    assert width.fewer_bits_pay(10 * GBIT, 0.05e-9)
    assert not width.fewer_bits_pay(GBIT, 1.0e-9)  # equal: the bytes do not pay for the codec
    with pytest.raises(ValueError, match="link_Bps"):
        width.fewer_bits_pay(0.0, 1e-9)
    with pytest.raises(ValueError, match="exposed_s"):
        width.fewer_bits_pay(GBIT, 1e-9, exposed_s=float("nan"))


def test_the_exposure_counts_where_the_host_waits_on_the_network():
    from gradientflow.wrapper.auto import exposure_is_timed

    assert exposure_is_timed(torch.device("cpu"), "gloo")
    assert exposure_is_timed(torch.device("cuda", 0), "gloo")  # staged through the host: the host waits on Gloo
    # NCCL: the end of backward queues the wait on a stream and returns; its host time is no measure of the link
    assert not exposure_is_timed(torch.device("cuda", 0), "nccl")


def test_the_warm_up_exposure_leaves_out_its_first_steps_and_reads_each_step_once(monkeypatch: pytest.MonkeyPatch):
    from types import SimpleNamespace

    from gradientflow.wrapper import auto

    state = auto.AutoState(requested=True)
    auto._start_deciding(state)  # as at the switch, the forward of step 1
    sync = SimpleNamespace(step=1, warmup=20)
    stats = SimpleNamespace(exposed_seconds=0.0)
    model = SimpleNamespace(_gf_auto=state, _gf_engine=SimpleNamespace(sync=sync, last_stats=stats))
    decided: list[int] = []
    monkeypatch.setattr(
        auto, "_decide_width", lambda m: (decided.append(sync.step), auto._start_deciding(state, False))
    )
    for step in range(2, 23):  # each step's forward sees the step before it
        sync.step, stats.exposed_seconds = step, float(step - 1)
        for _ in range(2):  # a second forward in the same step (an evaluation with grad on)
            if state.deciding:
                auto._watch_width(model)
    assert decided == [20]  # at the forward before the first 2-bit step, once
    assert state.exposed == [] and state.watched == 0  # cleared by the decision
    # what it decided on: the quantised steps 4-19, each once (1-3 left out: the first steps run here)
    auto._start_deciding(state)
    sync.step = 1
    for step in range(2, 20):
        sync.step, stats.exposed_seconds = step, float(step - 1)
        auto._watch_width(model)
        auto._watch_width(model)
    assert state.exposed == [float(s) for s in range(4, 19)]


def test_codec_extra_time_is_measured_per_gradient():
    extra = width.extra_seconds(torch.device("cpu"), 1 << 16)
    assert 0.0 <= extra < 1e-6  # ~2 ns here; a microsecond a gradient would be 1000x any measured codec


def test_codec_extra_time_is_measured_on_the_torch_ops_too(monkeypatch: pytest.MonkeyPatch):
    # what a CUDA rank (or a CPU one without a compiler) times: the torch ops, r materialised, each width's own
    # wire (a 3-bit-sized buffer for the 2-bit codes made the torch ops' scales the wrong length)
    from gradientflow.comm import codec_native

    monkeypatch.setattr(codec_native, "applies", lambda *t: False)
    extra = width.extra_seconds(torch.device("cpu"), 1 << 12)
    assert 0.0 <= extra < 1e-5


STEPS, WARMUP = 24, 20  # "q2npw20": its first 20 steps at 3 bits (the run's, step 0 included), then 2


def _train(model, net, opt, todo: list) -> tuple[list, list]:
    from torch.nn import functional as F

    history, sent = [], []
    for x, y in todo:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        history.append(torch.cat([p.detach().flatten() for p in net.parameters()]).tolist())
        sent.append(model.comm_stats()["payload_bytes"])  # this step's bytes
    return history, sent


def _worker(rank: int, world: int, link_Bps: float, exposed_s: float) -> dict:
    import gradientflow
    from gradientflow.engine.schedule import LinkEstimate
    from gradientflow.wrapper import auto

    measured = []

    def fake_link(*args: object) -> LinkEstimate:  # what engine.schedule.measure returns on that link
        measured.append(1)
        return LinkEstimate(alpha_s=1e-4, bulk_Bps=link_Bps)

    auto.measure_link = fake_link
    auto.last_exposed = lambda model: exposed_s  # what each 3-bit step left exposed on that link
    data = batches(rank, STEPS)

    def run(todo: list, resume: dict | None = None) -> tuple[dict, list, list, dict, str]:
        net = small_net()
        model = gradientflow.DistributedDataParallel(net, compression="auto")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if resume is not None:
            net.load_state_dict(resume["model"])
            opt.load_state_dict(resume["opt"])
            model.load_comm_state_dict(resume["comm"])
        during = ""
        history, sent = _train(model, net, opt, todo[:2])
        if todo[2:]:
            during = str(model.comm_stats()["compression"])  # after step 1, the first quantised one
            more = _train(model, net, opt, todo[2:])
            history, sent = history + more[0], sent + more[1]
        buf = io.BytesIO()
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "comm": model.comm_state_dict()}, buf)
        buf.seek(0)
        return model.comm_stats(), history, sent, torch.load(buf, weights_only=True), during

    stats, whole, sent, _, during = run(data)
    out: dict = {"compression": stats["compression"], "why": stats["compression_auto"], "per_step": sent}
    out["history"], out["measured"] = whole, len(measured)
    # saved before the switch (after the dense step 0), in the 3-bit warm-up (decided again at its end), after it
    for at in (1, 5, WARMUP + 2):
        _, head, _, ckpt, _ = run(data[:at])
        before = len(measured)
        resumed_stats, tail, _, _, _ = run(data[at:], ckpt)
        out[f"resumed_{at}"] = head + tail
        out[f"measured_on_resume_{at}"] = len(measured) - before
        out[f"resumed_why_{at}"] = resumed_stats["compression_auto"]
    out["during_warmup"] = during
    # the width decided at the switch instead of after the warm-up (as "auto" did before): where it is 3 bits, the
    # run after the warm-up's end is the same run, bit for bit (its residual carries the same 3-bit codes' error)
    deferred = auto.switch_if_chosen

    def at_switch(model: object) -> None:
        deferred(model)
        if model._gf_auto.deciding:  # type: ignore[attr-defined]
            auto._decide_width(model)

    auto.switch_if_chosen = at_switch
    try:
        out["decided_at_switch"] = run(data)[1]
    finally:
        auto.switch_if_chosen = deferred
    # a wrapper that decided the other width (on the other link): loading the decided checkpoint is an error
    link_Bps = 1e12 if link_Bps < 1e9 and exposed_s > 0 else 1e5
    exposed_s = 1.0
    net = small_net()
    model = gradientflow.DistributedDataParallel(net, compression="auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, net, opt, data[: WARMUP + 1])
    try:
        model.load_comm_state_dict(ckpt["comm"])
        out["other_width"] = "no error"
    except ValueError as exc:
        out["other_width"] = str(exc)
    return out


def _check_resumes(r: dict, width_name: str) -> None:
    # in the warm-up: the resumed run decides at its end, on its own measurement (the same fakes here: the same
    # width), bit for bit; after the decision: the checkpoint's width, without measuring again
    assert r["measured"] == 1 and r["measured_on_resume_5"] == 1, r
    assert r["resumed_5"] == r["history"]
    # saved before the switch: the checkpoint names the optimizer that chose, so the resumed switch is an Adam-type
    # optimizer's (2 ranks: the 3-bit warm-up, then the width), not plain "3bit"
    assert r["measured_on_resume_1"] == 1 and r["resumed_1"] == r["history"], r["resumed_why_1"]
    assert r["measured_on_resume_22"] == 0 and r["resumed_why_22"].startswith(width_name), r["resumed_why_22"]
    assert r["resumed_22"] == r["history"]


def test_auto_sends_two_bits_where_the_link_holds_the_step_back():
    n = 20 * 64 + 64 + 64 * 5 + 5  # small_net's 1669 parameters: one bucket of 14 blocks of 128
    # 0.8 Mbit/s: 1250 ns a gradient saved, and the 3-bit steps waited 1 s on it. The codec's extra time per
    # gradient is timed on the model's 1669: its fixed costs (a few calls, the floors' two means) over so few
    # gradients are ~100 ns each here
    slow = run_distributed(_worker, 2, 1e5, 1.0, timeout=300)
    for r in slow:
        assert r["compression"] == "2bit-precond", r["why"]
        assert r["why"].startswith("AdamW -> 2bit-precond (2 bits: 2-bit codes would save 1250.00 ns"), r["why"]
        assert "3-bit steps left exposed 1000.0 ms a step" in r["why"], r["why"]
        assert r["during_warmup"] == "2bit-precond"  # its warm-up: until step 20 the codes are 3-bit ones
        # step 0 dense fp32 (auto has not seen the optimizer), then the whole gradient quantised, sent to the
        # one peer: 3 bits (14 x 48 B codes + 14 x 2 B scales) until the warm-up's 20 steps are done (they count
        # the run's steps, so step 0 is the first), then 2 bits (14 x 32 + 14 x 2)
        assert r["per_step"] == [4 * n] + [14 * 50] * (WARMUP - 1) + [14 * 34] * (STEPS - WARMUP)
        _check_resumes(r, "2bit-precond")
        assert "sending '2bit-precond', this model switched to '3bit' already" in r["other_width"], r["other_width"]
    assert slow[0]["history"] == slow[1]["history"]  # identical ranks after every step


@pytest.mark.parametrize(("link_Bps", "exposed_s"), [(100 * GBIT, 1.0), (1e5, 0.0)])
def test_auto_keeps_three_bits_on_a_fast_link_or_where_the_wire_was_hidden(link_Bps: float, exposed_s: float):
    # 100 Gbit/s: 0.01 ns a gradient saved. 0.8 Mbit/s but the 3-bit steps never waited on the link (their bytes
    # went while backward ran): nothing to save. Either way the codec's extra time is not repaid
    n = 20 * 64 + 64 + 64 * 5 + 5
    for r in run_distributed(_worker, 2, link_Bps, exposed_s, timeout=300):
        assert r["compression"] == "3bit", r["why"]
        assert r["why"].startswith("AdamW -> 3bit (3 bits"), r["why"]
        assert r["per_step"] == [4 * n] + [14 * 50] * (STEPS - 1)  # 3 bits throughout, no step lost or doubled
        # decided at the switch, no step's exposure is known: on the fast link 3 bits, the same run bit for bit; on
        # the slow one 2 bits (what "auto" picked before it watched the warm-up), another run
        assert (r["decided_at_switch"] == r["history"]) == (link_Bps > 1e9)
        _check_resumes(r, "3bit")
        assert "sending '3bit', this model switched to '2bit-precond' already" in r["other_width"], r["other_width"]


def test_the_exposure_is_the_lower_quartile_of_a_bimodal_warm_up():
    from gradientflow.wrapper.auto import _lower_quartile

    # the 3-bit steps 4-19 of "auto" behind 500 Mbit/s (benchmarks/tta_adamw_auto_median_67f5123/500mbit_seed0, ms):
    # many wait 0-5 ms, the rest 10-24 ms where the link's bucket ran dry; their median, 12.3 ms, had "auto" pick
    # 2 bits, which were slower there; their lower quartile (exclusive method, by hand: the point a quarter of the
    # way from the 4th smallest, 4.4, to the 5th, 5.2) is 4.6 ms
    ms = [10.4, 5.2, 3.3, 15.5, 4.4, 0.0, 10.2, 19.2, 17.2, 11.9, 17.8, 23.9, 3.1, 20.6, 12.7, 14.2]
    assert _lower_quartile([m / 1e3 for m in ms]) == pytest.approx(4.6e-3)
    assert _lower_quartile([2e-3]) == 2e-3  # one step seen (a late resume): itself
