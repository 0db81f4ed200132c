"""Runtimes that execute a model's forward pass: torch (CPU/CUDA) and MLX."""
