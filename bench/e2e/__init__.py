"""The end-to-end benchmark's parts (bench/e2e_multiround.py is the command):

- workload.py  the multi-round QA shape (LMBenchmark's long-input / short-output run): users, rounds,
               shared system prompt, long per-user histories, short answers, fixed arrival rate
- configs.py   tier settings, engines, daemons and the configurations run over them
- client.py    one streamed /v1/completions request, timed as a client sees it
- runs.py      the runs: multi-round QA, no reuse, LMBenchmark's own client
- report.py    summaries, targets (PASS / MISS) and results.md
- plots.py     the PNGs (matplotlib)
"""
