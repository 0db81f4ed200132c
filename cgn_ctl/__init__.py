"""cgn-ctl."""
