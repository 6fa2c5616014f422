"""Kernels for the verification hot path. Each has a plain-torch reference; Triton versions
(issue 4) plug in behind the same functions."""
