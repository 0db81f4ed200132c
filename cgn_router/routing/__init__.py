"""Routing decisions: pure (no network, process or etcd; the decisions contract in
pyproject.toml): the chain and its plugins, the prefix index, breakers, admission, the
P/D split, and the records of a request's life."""
