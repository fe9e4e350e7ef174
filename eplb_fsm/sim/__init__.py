"""Simulation helpers: toy MoE model, load generators, and the multi-process launcher."""
