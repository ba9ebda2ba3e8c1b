"""The exchanges every door calls: one home per mechanism, whatever the tensor and whenever it runs.

A door (the DDP wrapper's buckets, an FSDP module's gradient shard, the outer loop's fragments) owns only what is
its own: where its tensor comes from and when it is exchanged.  What goes on the wire and what is kept for later
lives here, once:

- :mod:`.ring`: the quantised wire, started in one place (:func:`.ring.start_ring`, :func:`.ring.start_pair`)
  and advanced with every failure named through the watchdog (a lost or stalled peer is a
  :class:`~gradientflow.diagnostics.errors.CommunicationError` naming it, on every door);
- :mod:`.quantized`: :class:`.quantized.QuantizedExchange`, the quantised exchange's state between calls (the
  quantiser, the warm-up's count, the preconditioner around the ring);
- :mod:`.error_feedback`: error feedback's state, the one place a residual is allocated (:func:`.error_feedback.zeros`);
- :mod:`.precondition`: the preconditioner's divisor;
- :mod:`.selection`: the top-k exchanges' pure functions (chunk scores, selection, the density ramp).
"""
