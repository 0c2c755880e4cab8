"""Host memory the daemon owns (the host arena) and engine pool mappings."""
