"""`model-runner`: the reference engine behind an OpenAI-compatible HTTP endpoint.

    model-runner --service unix:///run/kvservice/kvservice.sock --model tiny --port 8001

Prints one line, "model-runner listening on http://HOST:PORT", once requests are served (with --port 0,
the port picked); SIGTERM or SIGINT stops the HTTP server, then the engine, and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from types import FrameType

from model_runner.config import PRESETS, EngineConfig

log = logging.getLogger("model_runner")


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(prog="model-runner", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--service", default=d.service, metavar="TARGET",
                   help="kvservice daemon, e.g. unix:///run/kvservice/kvservice.sock; empty: GPU tier only")
    p.add_argument("--model", default=d.model, choices=sorted(PRESETS), help="model shape preset")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model names clients may ask for (the first is the default) [the preset's name]")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8001, help="HTTP port; 0 picks a free one")
    p.add_argument("--device", default=d.device, help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens-per-block", type=int, default=d.tokens_per_block)
    p.add_argument("--gpu-blocks", type=int, default=d.num_gpu_blocks, help="GPU-tier KV pool size, in blocks")
    p.add_argument("--max-running", type=int, default=d.max_running, help="requests decoding at once")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prompt tokens one step admits for computing (at least one request); 0: no limit")
    p.add_argument("--prefetch-reqs", type=int, default=d.prefetch_reqs,
                   help="queued requests to prefetch for; 0 disables")
    p.add_argument("--no-write-through", dest="write_through", action="store_false",
                   help="offload blocks only when the GPU tier evicts them, not after every prefill")
    p.add_argument("--load-policy", default=d.load_policy, choices=["auto", "always", "never"],
                   help="auto: load from the service or recompute, whichever measures cheaper")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly, without CUDA graphs (as vLLM's flag)")
    p.add_argument("--seed", type=int, default=d.seed, help="weights seed (part of the KV namespace)")
    p.add_argument("--client-name", default="", help="session name shown by the daemon [model-runner[PID]]")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="fail a request still unfinished after this long")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    positive = {"--tokens-per-block": args.tokens_per_block, "--gpu-blocks": args.gpu_blocks,
                "--max-running": args.max_running}
    for flag, v in positive.items():
        if v < 1:
            raise ValueError(f"{flag} must be >= 1")
    if args.prefetch_reqs < 0:
        raise ValueError("--prefetch-reqs must be >= 0")
    if args.max_prefill_tokens < 0:
        raise ValueError("--max-prefill-tokens must be >= 0")
    if not 0 <= args.port <= 65535:
        raise ValueError("--port must be in 0..65535")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ValueError("--device must be cpu, cuda or cuda:N")
    return EngineConfig(model=args.model, seed=args.seed, dtype=args.dtype, device=args.device,
                        tokens_per_block=args.tokens_per_block, num_gpu_blocks=args.gpu_blocks,
                        max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
                        prefetch_reqs=args.prefetch_reqs,
                        write_through=args.write_through, load_policy=args.load_policy, service=args.service,
                        cuda_graphs=not args.enforce_eager)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = engine_config(args)
    except ValueError as e:
        parser.error(str(e))

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():  # a second signal: the clean path is stuck, leave now
            os._exit(1)
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    # Installed before the slow start so that a signal during it still ends in a clean stop.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Imported here so that --help and flag errors do not pay for importing torch.
    from model_runner.engine import Engine
    from model_runner.http_api import serve_http

    engine = Engine(cfg, client_name=args.client_name or f"model-runner[{os.getpid()}]")
    engine.start()
    try:
        try:
            server = serve_http(engine, args.host, args.port, served_names=args.served_model_name or [cfg.model],
                                request_timeout_s=args.request_timeout)
        except OSError as e:
            log.error("cannot listen on %s:%s: %s", args.host, args.port, e)
            return 1
        try:
            print(f"model-runner listening on {server.url}", flush=True)
            while not stop.wait(1.0):  # a timed wait keeps the main thread responsive to signals
                pass
        finally:
            server.close()
    finally:
        engine.stop()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
