"""model_runner: the reference engine process that uses the kvservice daemon.

Modules: config (presets), tokenizer (bytes), model (Llama-style decoder over a paged KV pool),
kv_pool (the pool registered with the daemon), radix (GPU-tier prefix cache over block hashes),
allocator, scheduler (admit, park on loads, prefetch), engine (the loop), http_api, cli.
"""
