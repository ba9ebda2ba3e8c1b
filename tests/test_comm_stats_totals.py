"""``comm_stats(total=True)`` sums every per-step count and byte figure, and ``payload_bytes`` means one thing on
every step: the bytes of gradient data this rank hands to the exchange between nodes, in the wire's encoding.

On 2 nodes of 2 ranks (``topology="2x2"``, named: the ranks are forked without torchrun's variables), with the
small net in one bucket per parameter (1280 + 64 + 320 + 5 elements), each rank hands its half of each node-summed
bucket between nodes: ceil(n / 2) elements, 835 in all, 3340 bytes in fp32, whether the step is a dense warm-up
step or a compressed one; CSC adds its fp32 chunk scores (4 bytes a chunk) on the steps it selects chunks.  Between
2 nodes a ring sends each shard once (2 (M-1)/M = 1 of it, the quantised ring one quantised copy), so a step's
payload less its scores is exactly the ``inter_node_bytes`` the exchange counted as sent.
"""

from __future__ import annotations

import torch
from _quant_training import batches, small_net

from _dist import run_distributed

STEPS = 3
RECIPES: dict[str, dict] = {
    "dense": {},  # fp32
    "csc": {"compression": "csc", "warmup_steps": 1},  # step 0 dense on its fp16 wire, then sparse
    "cscq": {"compression": "cscq", "warmup_steps": 1},  # step 0 dense in fp32, then quantised chunks
    "quantized": {"compression": "quantized"},
}
SHARD_ELEMENTS = sum(-(-n // 2) for n in (1280, 64, 320, 5))  # 640 + 32 + 160 + 3 = 835
LAYOUT_KEYS = ("nodes", "ranks_per_node", "topology", "compression")  # what the run is, in both dicts, not summed


def _run(rank: int, world: int) -> dict:
    """Each recipe: every step's ``comm_stats()`` and the run's totals (phase seconds included)."""
    import gradientflow

    out = {}
    for name, opts in RECIPES.items():
        ddp = gradientflow.DistributedDataParallel(small_net(), fusion_threshold_mb=0.0, topology="2x2", **opts)
        steps = []
        for x, y in batches(rank, STEPS):
            ddp.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            steps.append(ddp.comm_stats())
        out[name] = {"steps": steps, "total": ddp.comm_stats(total=True)}
    return out


def test_totals_are_the_sum_of_the_steps_and_payload_is_the_exchange_between_nodes() -> None:
    from gradientflow.diagnostics.stats import PER_STEP_ONLY

    for rank, records in enumerate(run_distributed(_run, 4, timeout=240)):
        for name, rec in records.items():
            steps, total = rec["steps"], rec["total"]
            assert total["steps"] == STEPS
            assert "inter_node_bytes" in total and "intra_node_bytes" in total, (name, total)
            for key in {k for s in steps for k in s}:
                if key in PER_STEP_ONLY:  # a step's setting (its density, its chunk count): no sum
                    assert key not in total, (name, key)
                elif key in LAYOUT_KEYS:
                    assert total[key] == steps[-1][key], (name, key)
                else:  # added in step order, as sum() adds: equal to the last bit, seconds too
                    assert total[key] == sum(s[key] for s in steps if key in s), (name, key, rank)

            for t, s in enumerate(steps):
                sparse = name.startswith("csc") and s["warmup"] == 0
                scores = 4 * s["n_chunks"] if sparse else 0
                assert s["payload_bytes"] - scores == s["inter_node_bytes"], (name, t, s)
                if not sparse and name != "quantized":  # dense: the shards, in the wire dtype
                    itemsize = 2 if name == "csc" else 4  # CSC's default wire is fp16
                    assert s["payload_bytes"] == itemsize * SHARD_ELEMENTS, (name, t, s)
            if name.startswith("csc"):
                assert [s["warmup"] for s in steps] == [1, 0, 0], name  # both kinds of step were checked
