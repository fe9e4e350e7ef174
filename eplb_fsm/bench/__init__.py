"""Benchmarks: each prints JSON with ratios against a baseline measured in the same run."""
