"""Shared core of Cognitora: settings, errors, logging, block hashing, etcd client."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cognitora-cluster")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
