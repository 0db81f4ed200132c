"""What the catalog's modules share (catalog.py, adapters.py): the error every refusal
raises, its message starting with the field path, and the rule for the names clients use."""

from __future__ import annotations

from cgn_core.keys import NAME

__all__ = ["NAME", "CatalogError"]


class CatalogError(ValueError):
    """A model spec that cannot be stored; the message starts with the field path."""
