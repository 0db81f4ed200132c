"""A stand-in for SGLang's package: only `python -m sglang.launch_server` (rank_stub.py)."""
