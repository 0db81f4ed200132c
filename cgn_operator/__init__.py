"""cgn-operator."""
