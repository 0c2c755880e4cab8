"""kvservice: the node-local KV-cache daemon (host and disk tiers, retention, disk I/O)."""

__version__ = "0.1.0"
