"""cgn-kvcached."""
