"""Sampling, in two modules: `rules.py` (what a temperature, top-p, top-k, seed or token budget may be; no torch,
so the server's torch-free API checks requests with it) and `sampler.py` (the per-row sampler itself, on torch)."""
