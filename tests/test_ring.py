"""Specification of the ring allreduce (gradientflow.comm.ring) against the backend's own allreduce.

Spawning a process group costs seconds on two cores, so each world size is spawned once: one
worker runs every case and returns what it saw, and the tests below read those records.
"""

from __future__ import annotations

import functools
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradientflow.comm.collectives import as_member, start_allreduce
from gradientflow.comm.ring import ring_allreduce
from gradientflow.config import ALGORITHMS

from _dist import run_distributed

WORLD_SIZES = (1, 2, 3, 4)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BIG = 1000003  # odd, prime: no segment or piece boundary lines up with anything


def _lengths(world: int) -> list[int]:
    return sorted({0, 1, max(world - 1, 0), world, 7, BIG})


def _rows(world: int, n: int, dtype: torch.dtype, seed: int, integer: bool) -> torch.Tensor:
    """Every rank's input, identical on all ranks (a fixed seed), row r for rank r."""
    g = torch.Generator().manual_seed(seed)
    if integer:  # |sum| <= 4 * world: exact in every dtype, in any summation order
        return torch.randint(-4, 5, (world, n), generator=g).to(dtype)
    return torch.randn(world, n, generator=g, dtype=torch.float64).to(dtype)


def _tolerance(rows: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |ring - native| for a float sum of N values in two different orders.

    Each of the N-1 additions rounds with relative error <= u (unit roundoff = eps/2), so either
    result is within (N-1) u sum|x_i| of the exact sum (Higham, Accuracy and Stability, 4.2)
    and the two differ by at most twice that.  The absolute term covers fp16 subnormals, whose
    spacing (tiny * eps) is the rounding unit there.
    """
    fi = torch.finfo(rows.dtype)
    world = rows.shape[0]
    return 2 * (world - 1) * (fi.eps / 2 * rows.double().abs().sum(0) + fi.tiny * fi.eps)


def _adversarial(world: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Partial sums that lose bits: per element one rank holds B in [2^p, 2^(p+1)) (ulp 1), the
    others hold s in [0.25, 0.5).  Each s alone rounds away when added to B, their sum does not.
    All values are multiples of 2^-7, so every partial sum is exact in fp32 (< 2^24 units)."""
    p = round(-math.log2(torch.finfo(dtype).eps))  # stored mantissa bits: 10 (fp16), 7 (bf16)
    g = torch.Generator().manual_seed(1234)
    rows = torch.randint(32, 64, (world, n), generator=g).double() / 128  # s in [0.25, 0.5)
    big = 2.0**p + torch.randint(0, 2**p, (n,), generator=g).double()
    owner = torch.arange(n) % world  # B moves around, so it meets every summation order
    rows[owner, torch.arange(n)] = big
    return rows.to(dtype)


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    out: dict = {"exact": [], "close": [], "checked": 0}

    # 1. Integer-valued inputs: the sum is exact in every dtype, so ring == native bit for bit.
    #    Three piece sizes: the default, many pieces per segment, and 4-byte pieces, which makes
    #    the shorter segments of a small tensor have empty pieces.
    for n in _lengths(world):
        for dtype in DTYPES:
            for pipeline_bytes in (None, 1 << 16, 4):
                if n == BIG and pipeline_bytes != 1 << 16:
                    continue  # one piece size is enough here; 4-byte pieces would be 10^6 messages
                rows = _rows(world, n, dtype, seed=n, integer=True)
                native, ring = rows[rank].clone(), rows[rank].clone()
                dist.all_reduce(native)
                kw = {} if pipeline_bytes is None else {"pipeline_bytes": pipeline_bytes}
                ring_allreduce(ring, **kw)
                out["checked"] += 1
                if not torch.equal(ring, native) or not torch.equal(ring, rows.double().sum(0).to(dtype)):
                    out["exact"].append((n, str(dtype), pipeline_bytes))

    # 2. Random normal inputs: ring and native differ only by summation order (see _tolerance).
    for dtype in DTYPES:
        rows = _rows(world, BIG, dtype, seed=7, integer=False)
        native, ring = rows[rank].clone(), rows[rank].clone()
        dist.all_reduce(native)
        ring_allreduce(ring, pipeline_bytes=1 << 18, pipeline_depth=1)  # no overlap: still correct
        excess = (ring.double() - native.double()).abs() - _tolerance(rows)
        if excess.max().item() > 0:
            out["close"].append((str(dtype), excess.max().item()))

    # 3. fp16/bf16 with fp32 accumulation vs plain sums, against an fp64 reference.
    out["acc"] = {}
    if world > 1:
        for dtype in (torch.float16, torch.bfloat16):
            rows = _adversarial(world, 4096, dtype)
            exact = rows.double().sum(0)
            native, plain, acc = rows[rank].clone(), rows[rank].clone(), rows[rank].clone()
            dist.all_reduce(native)
            ring_allreduce(plain, pipeline_bytes=1024)
            ring_allreduce(acc, accumulate_dtype=torch.float32, pipeline_bytes=1024)
            out["acc"][str(dtype)] = {
                "native_err": (native.double() - exact).abs().sum().item(),
                "plain_err": (plain.double() - exact).abs().sum().item(),
                "acc_err": (acc.double() - exact).abs().sum().item(),
                "acc_correctly_rounded": torch.equal(acc, exact.to(dtype)),
            }

    # 4. The engine's entry point, on the default group and (world 4) on subgroups whose group
    #    ranks differ from global ranks; non-members pass through new_group but do not call.
    out["start"] = []
    groups: list[tuple[str, list[int] | None]] = [("default", None)]
    if world == 4:
        groups += [("pair", [1, 3]), ("trio", [0, 2, 3])]
    for name, members in groups:
        group = None if members is None else dist.new_group(members, timeout=timedelta(seconds=60))
        if members is not None and rank not in members:
            continue
        size = world if members is None else len(members)
        rows = _rows(size, 100_001, torch.float32, seed=3, integer=True)
        me = rank if members is None else members.index(rank)
        t = rows[me].clone()
        handle = start_allreduce(t, group=group, algorithm="ring")
        done_before_wait = handle.completed_at is not None
        result = handle.wait()
        out["start"].append((name, done_before_wait, result is t, torch.equal(t, rows.sum(0))))
    return out


@functools.cache
def _results(world: int) -> list[dict]:
    return run_distributed(_worker, world, timeout=120)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_equals_native_on_integer_valued_inputs(world):
    for rank, res in enumerate(_results(world)):
        assert res["checked"] == (len(_lengths(world)) * 3 - 2) * len(DTYPES)
        assert res["exact"] == [], f"rank {rank}: (n, dtype, pipeline_bytes) where ring != native: {res['exact']}"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_close_to_native_on_random_inputs(world):
    for rank, res in enumerate(_results(world)):
        assert res["close"] == [], f"rank {rank}: (dtype, max excess over the rounding bound): {res['close']}"


@pytest.mark.parametrize("world", (2, 3, 4))
@pytest.mark.parametrize("dtype", ("torch.float16", "torch.bfloat16"))
def test_fp32_accumulation_beats_plain_half_sum(world, dtype):
    for res in _results(world):
        r = res["acc"][dtype]
        # One rounding at the end: the correctly rounded sum, whatever the input.
        assert r["acc_correctly_rounded"], r
        if world == 2:
            # A single addition is already correctly rounded in fp16: nothing to gain.
            assert r["acc_err"] == r["native_err"] == r["plain_err"], r
        else:
            # N-1 roundings of partial sums each drop an s < ulp/2; fp32 partials keep them.
            assert r["acc_err"] < 0.5 * r["native_err"], r
            assert r["acc_err"] < 0.5 * r["plain_err"], r


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_start_allreduce_ring(world):
    expected = {1: 1, 2: 1, 3: 1, 4: 3}  # groups each rank belongs to: default (+ pair, trio)
    for rank, res in enumerate(_results(world)):
        if world == 4:
            expected[4] = 1 + (rank in (1, 3)) + (rank in (0, 2, 3))
        assert len(res["start"]) == expected[world]
        for name, done_before_wait, same_tensor, correct in res["start"]:
            assert done_before_wait and same_tensor and correct, (rank, name)


def test_ring_rejects_non_contiguous_input():
    with pytest.raises(ValueError, match="contiguous"):
        ring_allreduce(torch.zeros(4, 4).t())


def test_start_allreduce_rejects_unknown_algorithm():
    assert ALGORITHMS == ("native", "ring")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        start_allreduce(torch.zeros(3), algorithm="tree")


def _member_worker(rank: int, world: int) -> tuple[bool, str]:
    groups = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating each group
    mine = as_member(groups[rank], [rank])
    try:
        as_member(groups[1 - rank], [1 - rank])
    except RuntimeError as exc:
        return isinstance(mine, dist.ProcessGroup) and dist.get_world_size(mine) == 1, str(exc)
    return False, "no error for a group this rank is not among"


def test_as_member_keeps_a_ranks_own_group_and_names_one_it_is_not_among():
    """``as_member``: torch 2.14 types ``new_group``'s result as a group or ``GroupMember.NON_GROUP_MEMBER`` (-100,
    what a rank outside the ranks gets); a rank's own group passes through, another's is refused naming its ranks."""
    for rank, (own_ok, message) in enumerate(run_distributed(_member_worker, 2)):
        assert own_ok, message
        assert message.startswith(f"gradientflow: rank {rank} uses the group of ranks [{1 - rank}]"), message
        assert "-100" in message
