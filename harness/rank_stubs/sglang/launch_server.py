"""A stand-in for `python -m sglang.launch_server` across nodes (../rank_stub.py)."""

import rank_stub

if __name__ == "__main__":
    rank_stub.main("sglang")
