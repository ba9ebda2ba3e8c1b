"""What the cost model needs to know about a model: gradient sizes, backward order, ready times.

Two sources, one result (:class:`ModelProfile`):

* :func:`flop_profile` — no timing at all.  Forward hooks on every leaf module, run once on the
  ``meta`` device (no memory, no compute), record each call's FLOPs; backward is assumed to
  visit the calls in reverse and to spend time in proportion to their FLOPs (a backward pass
  costs about twice the forward FLOPs of every layer alike, so the shares are the same).
* :func:`measured_profile` (``--profile``) — run forward/backward/update here and stamp, with
  ``register_post_accumulate_grad_hook``, the moment each gradient is complete: the same event
  the engine's own hooks react to.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelProfile:
    """Per parameter (registration order): its size and when in backward its gradient is ready.

    ready[i] is a fraction of the backward time (0 = backward starts, 1 = it ends); ``order``
    is the parameter indices sorted by it (backward order).  ``times`` is (forward, backward,
    update) seconds when measured here, else None (the cost model then scales FLOP shares);
    ``local_s`` the engine's local passes timed here, else None (then cfg.pass_bytes_per_s).
    """

    name: str
    numels: tuple[int, ...]
    order: tuple[int, ...]
    ready: tuple[float, ...]
    source: str
    flops_per_sample: float = 0.0
    times: tuple[float, float, float] | None = None
    local_s: dict[str, float] | None = None  # measured local passes per kind, see local_costs()
    batch: int | None = None

    @property
    def n_params(self) -> int:
        return sum(self.numels)


def _leaf_flops(mod: nn.Module, inp: tuple, out: object) -> float:
    """Forward FLOPs of one call: 2·MACs for conv and linear layers, one per output element else."""
    if not isinstance(out, torch.Tensor):
        return 0.0
    if isinstance(mod, nn.modules.conv._ConvNd):
        per_out = mod.in_channels // mod.groups * math.prod(mod.kernel_size)
        return 2.0 * out.numel() * per_out
    if isinstance(mod, nn.Linear):
        return 2.0 * out.numel() * mod.in_features
    return float(out.numel())


def _order(ready: list[float]) -> tuple[int, ...]:
    # Ties (weight and bias of one layer) go to the higher index first, as the engine's initial
    # guess "backward roughly reverses registration".
    return tuple(sorted(range(len(ready)), key=lambda i: (ready[i], -i)))


INPUT_DTYPES = {"float": torch.float32, "long": torch.int64, "int": torch.int32}
"""``--input-dtype``: what the probe input of a model is made of (default: :func:`infer_input_dtype`)."""


def infer_input_dtype(model: nn.Module) -> torch.dtype:
    """Token ids (int64) for a model whose first layer is an ``nn.Embedding`` (a language model),
    float32 otherwise: the first leaf module in registration order stands for the first layer."""
    first = next((m for m in model.modules() if not list(m.children())), None)
    return torch.int64 if isinstance(first, (nn.Embedding, nn.EmbeddingBag)) else torch.float32


def probe_input(
    model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype | None, device: str = "cpu"
) -> torch.Tensor:
    """An input of ``shape`` for ``model``: N(0, 1) floats, or integer ids every embedding of the
    model can look up (below the smallest ``num_embeddings``)."""
    dtype = dtype or infer_input_dtype(model)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    vocab = min(
        (m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))), default=1
    )
    return torch.randint(0, vocab, shape, dtype=dtype, device=device)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return next((k for k, v in INPUT_DTYPES.items() if v == dtype), str(dtype))


def flop_profile(
    name: str, factory: Callable[[], nn.Module], input_shape: tuple[int, ...], input_dtype: torch.dtype | None = None
) -> ModelProfile:
    """Sizes and FLOP-share ready times of ``factory()``'s parameters, one sample of ``input_shape``
    (of ``input_dtype``, default :func:`infer_input_dtype`).

    1. Build the model on ``meta`` (falls back to CPU for a factory that cannot) and hook every
       module; one forward records, in call order, (leaf module, FLOPs) as each leaf returns and
       (other module, 0) as each other module is entered.
    2. Walk the calls in reverse (backward order), accumulating FLOPs; a parameter is ready when
       the *earliest* forward call using it has been walked back (its last gradient contribution).
       A parameter no leaf call touched (``nn.MultiheadAttention``'s projections, used through
       ``F.multi_head_attention_forward``) is ready when the module holding it is walked back.
    3. Parameters never used in forward are ready at the end of backward.
    """
    try:
        with torch.device("meta"):
            model = factory()
        device = "meta"
    except Exception:  # noqa: BLE001 — a factory doing real work at build time; plain CPU then
        model = factory()
        device = "cpu"
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r}: the factory returned {type(model).__name__}, not an nn.Module")
    dtype = input_dtype or infer_input_dtype(model)
    x = probe_input(model, (1, *input_shape), dtype, device)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"model {name!r} has no trainable parameters: nothing to communicate")
    index = {id(p): i for i, p in enumerate(params)}
    calls: list[tuple[nn.Module, float | None]] = []  # None: a non-leaf module entered
    hooks = [
        m.register_forward_hook(lambda m, i, o: calls.append((m, _leaf_flops(m, i, o))))
        if not list(m.children())
        else m.register_forward_pre_hook(lambda m, i: calls.append((m, None)))
        for m in model.modules()
    ]
    try:
        with torch.no_grad():
            model(x)
    except Exception as exc:
        raise ValueError(
            f"model {name!r} failed on a {_dtype_name(dtype)} input of shape {(1, *input_shape)} ({exc}); "
            "pass its per-sample shape with --input-shape (and --input-dtype long for token ids)"
        ) from None
    finally:
        for h in hooks:
            h.remove()
    total = sum(f or 0.0 for _, f in calls) or 1.0
    ready: list[float | None] = [None] * len(params)
    done = 0.0
    for mod, flops in reversed(calls):
        if flops is None:  # entering a module: what no leaf call claimed is ready here
            for p in mod.parameters():
                if id(p) in index and ready[index[id(p)]] is None:
                    ready[index[id(p)]] = done / total
            continue
        done += flops
        for p in mod.parameters(recurse=False):
            if id(p) in index:
                ready[index[id(p)]] = done / total  # a later (earlier-in-forward) call overrides
    final = [1.0 if r is None else r for r in ready]
    return ModelProfile(
        name, tuple(p.numel() for p in params), _order(final), tuple(final), "flops", flops_per_sample=total
    )


def local_costs(numel: int, repeats: int = 3) -> dict[str, float]:
    """Seconds of the engine's own per-step CPU passes over a pool of ``numel`` fp32 gradients.

    The engine's own functions and ops (precision.py, selection.py, csc.py), timed here: "fp32"
    pre-divide in place; "fp16" pre-divide, cast into the wire buffer, copy back; "csc" (the
    default recipe: no momentum correction) the per-chunk L1 score of the whole pool (nothing
    where CSC's C kernel sums it during the accumulation); "csc_accumulate" the addition of a
    fresh gradient into the residual (pool-sized here; with the kernel, scoring as it adds);
    "csc_chunks" what CSC does to the *selected* chunks only (clear last step's in the pool, pack
    onto the fp16 wire, write back, mask in the residual), timed here on every chunk:
    the cost model scales it by the fraction of chunks selected; "quantized" the quantised recipe's
    codec (:mod:`gradientflow.comm.quantize`, 3 bits, 128-element blocks; on CPU its C kernel) as
    one rank of a 2-rank ring runs it: the contribution ``g + e``, one quantisation of every element
    (with its error), one decoding of every element (half in the reduce-scatter, with an add, half in
    the allgather).
    """
    from gradientflow.comm.precision import from_wire, to_wire  # noqa: PLC0415
    from gradientflow.comm.quantize import dequantize, quantize, wire_bytes  # noqa: PLC0415
    from gradientflow.exchange.selection import chunk_scores  # noqa: PLC0415
    from gradientflow.strategies import csc_native  # noqa: PLC0415
    from gradientflow.strategies.writeback import zero_rows  # noqa: PLC0415

    g = torch.randn(numel)
    residual = torch.randn(numel)
    rows = g[: (numel // 32768) * 32768].view(-1, 32768)
    every = torch.arange(rows.shape[0])
    packed = torch.empty_like(rows)
    wire = torch.empty(numel, dtype=torch.float16)  # the engine keeps its wire buffers between steps
    qwire = torch.empty(wire_bytes(numel, 3, 128), dtype=torch.uint8)
    err = torch.empty(numel)
    x = g.clone()  # quantised in place, as the ring does
    scores = torch.zeros(-(-numel // 32768))
    native = csc_native.available()  # CPU fp32 with a C compiler: the engine's kernels, timed as it runs them
    rows_wire = wire[: rows.numel()]
    ops: dict[str, list[Callable[[], object]]] = {
        "fp32": [lambda: to_wire(g, None, 2)],
        "fp16": [lambda: to_wire(g, torch.float16, 2, out=wire), lambda: from_wire(g, wire)],
        # with the kernel the score is summed while the gradient is added (csc_accumulate): no pass
        "csc": [] if native else [lambda: chunk_scores(rows)],
        "csc_accumulate": [lambda: csc_native.add_l1(residual, g, 0, 32768, scores)]
        if native
        else [lambda: residual.add_(g)],
        # clear last step's chunks in the pool, pack, write back, mask in the residual
        "csc_chunks": [
            lambda: zero_rows(rows, every),
            *(
                (
                    lambda: csc_native.pack_rows(rows, every, 0.5, rows_wire),
                    lambda: csc_native.unpack_rows(rows, every, rows_wire),
                )
                if native
                else (
                    lambda: torch.index_select(rows, 0, every, out=packed),
                    lambda: rows.index_copy_(0, every, packed),
                )
            ),
            lambda: zero_rows(rows, every),
        ],
        "quantized": [
            lambda: residual.add_(g),
            lambda: quantize(x, qwire, 3, 128, err=err, inplace=True),
            lambda: dequantize(qwire, numel, 3, 128, out=residual, add=True),
        ],
    }
    out = {}
    for kind, calls in ops.items():
        total = 0.0
        for op in calls:
            op()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                op()
                ts.append(time.perf_counter() - t0)
            total += statistics.median(ts)
        out[kind] = total
    return out


def measured_profile(
    name: str,
    factory: Callable[[], nn.Module],
    input_shape: tuple[int, ...],
    batch: int,
    steps: int = 3,
    threads: int = 1,
    input_dtype: torch.dtype | None = None,
) -> ModelProfile:
    """Time ``steps`` local training steps (after one warm-up) of ``factory()`` on this CPU.

    1. SGD with momentum, cross-entropy on random labels, ``threads`` torch threads (the bench
       runs 1 per rank on this 2-core machine).
    2. Per step: forward time, backward time, update time; every parameter's ready time
       (post-accumulate-grad hook) as a fraction of that step's backward.
    3. Medians over the steps; also the engine's local passes over a pool of this size.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = factory()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    x = probe_input(model, (batch, *input_shape), input_dtype)
    stamps: list[float] = [0.0] * len(params)
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))
    fwd, bwd, upd, readies = [], [], [], []
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = model(x)
        if out.dim() == 2:  # a classifier, as the bench trains it
            loss = nn.functional.cross_entropy(out, torch.randint(0, out.shape[-1], out.shape[:1]))
        else:  # any other output: a loss whose backward touches every output once
            loss = out.float().square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if step:  # step 0 is the warm-up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            upd.append(t3 - t2)
            readies.append([min(max((s - t1) / (t2 - t1), 0.0), 1.0) for s in stamps])
    ready = [statistics.median(r[i] for r in readies) for i in range(len(params))]
    times = (statistics.median(fwd), statistics.median(bwd), statistics.median(upd))
    numels = tuple(p.numel() for p in params)
    return ModelProfile(
        name, numels, _order(ready), tuple(ready), "profile", times=times, local_s=local_costs(sum(numels)), batch=batch
    )
