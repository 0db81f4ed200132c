"""The control plane's decisions: pure (the decisions contract in pyproject.toml): what
the catalog means, where replicas go, how many, what to change, what status shows."""
