"""cgn-router."""
