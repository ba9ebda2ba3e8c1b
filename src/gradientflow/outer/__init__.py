"""Fewer syncs between nodes (DiLoCo, arXiv 2311.08105; streaming DiLoCo, arXiv 2501.18512): the replicas step
apart on their own gradients for ``sync_every`` optimizer steps, then the pseudo-gradient (the last synchronised
parameters minus the current ones) is averaged and an outer optimizer sets every replica to the same parameters.

- :mod:`.fragments` — the parameters cut into fragments and the steps each is synchronised at (pure);
- :mod:`.nesterov` — the outer optimizer's update (pure tensor arithmetic);
- :mod:`.exchange` — the average of the pseudo-gradient across replicas: dense (fp32, fp16, bf16) or the
  quantised exchange with error feedback (:class:`gradientflow.comm.quantized_ring.QuantizedRing`), on nodes of
  several ranks one shard per local rank between nodes, then an all-gather inside the node;
- :mod:`.loop` — :class:`OuterLoop`, the state (last synchronised parameters, outer momentum, the step phase)
  and the sync itself, nothing changed unless the exchange completed.

The wrapper only wires it in (:mod:`gradientflow.wrapper.fewer_syncs`); docs/fewer-syncs.md.
"""
