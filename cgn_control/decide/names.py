"""What the catalog's modules share (catalog.py, adapters.py): the error every refusal
raises, its message starting with the field path, and the rule for the names clients use."""

from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # a model, alias or adapter


class CatalogError(ValueError):
    """A model spec that cannot be stored; the message starts with the field path."""
