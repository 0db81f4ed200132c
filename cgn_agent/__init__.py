"""cgn-agent."""
