"""Benchmarks: each measures peerd against a baseline in one run and prints JSON lines (last = headline)."""
