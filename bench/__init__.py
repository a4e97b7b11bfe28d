"""Benchmarks: every timing side by side with a peer or a measured peak, and the GPU check."""
