"""Pure placement policies (no await, no I/O): the block index and entry states, LRU order,
eviction planning and retention caps. Unit-tested with an injected clock.
"""
