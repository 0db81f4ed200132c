"""What tests and benchmarks share: real processes on loopback, metrics read back, references.

Not shipped in the wheels (setuptools packages only `cgn_*`); both `tests/`
and `bench/` import it from the repository root.
"""
