"""The engine: gradient pool, the strategy protocol, the reducer that decides when buckets launch."""
