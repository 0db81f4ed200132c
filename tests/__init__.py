"""Cognitora tests."""
