"""Micro-benchmarks (pooling cost, ...) behind `vse bench`."""
