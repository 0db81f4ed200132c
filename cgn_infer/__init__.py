"""cgn-infer."""
