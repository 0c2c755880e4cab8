"""Client strings in logs and error messages: escaped, and never more than a short prefix.

A client-supplied string (a model id, a client name, a namespace id it sent) is shown with
`quoted`: Python's repr of at most `limit` characters, so a newline cannot forge a log line and
a megabyte of input cannot come back inside an error (or push a reply past the message limit).
"""

from __future__ import annotations

DEFAULT_LIMIT = 40


def quoted(value: str | bytes, limit: int = DEFAULT_LIMIT) -> str:
    """repr(value) for short values; repr of its first `limit` characters and its length otherwise."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} {'bytes' if isinstance(value, bytes) else 'characters'})"
