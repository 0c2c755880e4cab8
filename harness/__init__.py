"""Process harness shared by tests, benchmarks and the demo: a real daemon subprocess
(harness.daemon), stand-in engine processes (harness.engine, harness.engine_proc) and the block
numbering every process agrees on (harness.blocks). Not installed with the packages: it runs
from a checkout."""
