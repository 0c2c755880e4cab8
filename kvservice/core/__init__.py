"""The block cache: sessions, namespaces, the store/load/prefetch/retain calls and the tiers they
plan over (validate -> plan -> copy -> commit), with the ids, enums and results they share.
"""
