"""Communication: how a flat tensor crosses ranks (native allreduce, gradientflow's ring, the wire dtype)."""
