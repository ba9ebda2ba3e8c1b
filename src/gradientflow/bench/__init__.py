"""Benchmark workloads, real data and the emulated cluster."""
