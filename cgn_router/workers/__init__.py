"""The router's processes: the supervisor (supervisor.py) and its workers (`cgn-router worker`), the
rate-limit table they share (shared.py), and their metrics merged (metrics_merge.py)."""
