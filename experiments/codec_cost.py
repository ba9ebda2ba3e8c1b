"""What the quantised recipe's codec costs per step against the model's own step, on CPU or CUDA.

One rank of a 2-rank quantised allreduce runs, per step and gradient element: the contribution
``x = g/N + e`` (an add), one quantisation (codes, scales, decoded values and error) and one decoding
with an add.  This times exactly those calls (:mod:`gradientflow.comm.quantize`) on a buffer of the
model's gradient count, beside the model's forward + backward, on the same device:

    python experiments/codec_cost.py --device cpu --size 256x4 --batch 1
    python experiments/codec_cost.py --device cuda --size 256x4 --batch 8

On CPU it reports both codec paths (the C kernel of comm/codec.c and the torch ops it replaced).
Medians of ``--repeats``; CUDA timings synchronise around each call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from gradientflow.bench.models import build_model, synthetic_batch
from gradientflow.comm import codec_native
from gradientflow.comm.quantize import dequantize, quantize, wire_bytes


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="256x4", help="transformer d_model x layers (the TTA bench's: 256x4)")
    ap.add_argument("--batch", type=int, default=1, help="windows of 64 tokens per step")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core per rank, as the bench's ranks
    d, layers = (int(v) for v in args.size.split("x"))
    model = build_model("tiny_transformer", d_model=d, n_layers=layers).to(device)
    x, y = synthetic_batch("tiny_transformer", args.batch, 0, device)
    n = sum(p.numel() for p in model.parameters())

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(x)
        torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()

    g = torch.randn(n, device=device) * torch.rand(n, device=device) ** 4
    e, err, acc = torch.zeros_like(g), torch.empty_like(g), torch.zeros_like(g)
    wire = torch.empty(wire_bytes(n, 3, 128), dtype=torch.uint8, device=device)
    xbuf = g.clone()

    def codec() -> None:
        torch.add(g, e, out=xbuf)
        quantize(xbuf, wire, 3, 128, err=err, inplace=True)
        dequantize(wire, n, 3, 128, out=acc, add=True)

    res: dict[str, object] = {"device": str(device), "size": args.size, "batch": args.batch, "params": n}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    res["compute_ms"] = _median_ms(step, device, args.repeats)
    res["codec_ms"] = _median_ms(codec, device, args.repeats)
    if device.type == "cpu" and codec_native.library() is not None:
        applies = codec_native.applies
        codec_native.applies = lambda *t: False  # type: ignore[assignment]
        try:
            res["codec_torch_ops_ms"] = _median_ms(codec, device, args.repeats)
        finally:
            codec_native.applies = applies  # type: ignore[assignment]
    res["codec_ns_per_element"] = 1e6 * float(res["codec_ms"]) / n  # type: ignore[arg-type]
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
