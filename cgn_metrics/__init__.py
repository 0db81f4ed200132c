"""cgn-metrics."""
