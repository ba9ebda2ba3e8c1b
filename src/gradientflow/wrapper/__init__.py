"""The ``nn.Module`` face: torch DDP's constructor, forward, buffers, Join and checkpoints."""
