"""Helpers for tests that start real processes."""
