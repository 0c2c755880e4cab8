"""OpenAI-style HTTP front of the reference engine, on the standard library's http.server.

    server = serve_http(engine, "127.0.0.1", 8001)   # bound and serving in a background thread
    server.url                                       # "http://127.0.0.1:8001" (the real port for port 0)
    server.close()                                   # stop accepting, release the socket

Routes:
- POST /v1/completions: {"prompt": str | [token ids], "max_tokens", "temperature", "seed", "stream", ...};
  a JSON `text_completion`, or Server-Sent Events chunks (one per token, the last one with usage) and
  `data: [DONE]`. Extensions: request `kv_cache_ttl_seconds` (retain the prompt's KV on the service) and
  `stop_token_ids`; response `token_ids` (output ids) and `kv_cache` (cached tokens per tier, kv_source, ttft_ms).
- GET /health: 200 {"status": "ok", "model", **engine.health()}; still 200 while the service is detached,
  since the engine keeps serving by recomputing (`service_attached` says which).
- GET /metrics: the engine's Prometheus registry.

Text prompts are encoded with BOS first, as Llama-style servers do; token-id prompts are taken as given.
Unknown fields are ignored; known fields with invalid values, stop strings and n != 1 get a 400.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import prometheus_client

from model_runner.config import PRESETS
from model_runner.engine import Engine, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_TOKENS = 16


class RequestError(ValueError):
    """A client error: answered 400 with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """A validated /v1/completions body."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    kv_cache_ttl_seconds: float
    stop_ids: tuple[int, ...]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"'{key}' must be a finite number", key)
    return float(v)


def _token_ids(v: Any, key: str, vocab: int) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise RequestError(f"'{key}' must be a list of integer token ids", key)
    bad = [t for t in v if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"'{key}' has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", key)
    return list(v)


def parse_completion(body: Any, *, model_name: str, vocab: int, tokenizer: Any) -> CompletionParams:
    """Validate a decoded JSON body; raises RequestError with a message a client can act on."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(f"model '{model}' is not served here; this server serves '{model_name}'", "model")

    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt, add_bos=True)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("batched prompts are not supported; send one prompt per request", "prompt")
    else:
        prompt_ids = _token_ids(prompt, "prompt", vocab)
    if not prompt_ids:
        raise RequestError("'prompt' must not be empty", "prompt")

    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError("'max_tokens' must be a positive integer", "max_tokens")

    temperature = _number(body, "temperature", 0.0)
    if temperature < 0:
        raise RequestError("'temperature' must be >= 0", "temperature")
    ttl = _number(body, "kv_cache_ttl_seconds", 0.0)
    if ttl < 0:
        raise RequestError("'kv_cache_ttl_seconds' must be >= 0", "kv_cache_ttl_seconds")

    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError("'seed' must be an integer", "seed")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError("only n=1 is supported", "n")

    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise RequestError("stop strings are not supported; use 'stop_token_ids'", "stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = () if stop_ids is None else tuple(_token_ids(stop_ids, "stop_token_ids", vocab))

    return CompletionParams(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                            stream=stream, kv_cache_ttl_seconds=ttl, stop_ids=stop_ids)


class IncrementalText:
    """Turns output ids into text deltas whose concatenation equals tokenizer.decode(all ids).

    A byte-level tokenizer can end a step halfway through a UTF-8 character; the decoded tail is then
    U+FFFD, which a later byte may turn into a real character, so trailing U+FFFD is held back.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._sent = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        stable = self._tokenizer.decode(self._ids).rstrip("\ufffd")
        return self._advance(stable)

    def flush(self) -> str:
        return self._advance(self._tokenizer.decode(self._ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self._sent):
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta


def _kv_cache_ext(r: GenerationResult) -> dict:
    tiers = {t: int(r.cached_by_tier.get(t, 0)) for t in ("gpu", "host", "disk")}
    return {"cached_tokens_by_tier": tiers, "kv_source": r.kv_source,
            "ttft_ms": round(r.ttft_s * 1e3, 3), "total_ms": round(r.total_s * 1e3, 3)}


def _usage(r: GenerationResult) -> dict:
    completion = len(r.output_ids)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": completion,
            "total_tokens": r.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


class CompletionServer(ThreadingHTTPServer):
    """The HTTP server; handler threads read `engine` and `model_name` from here."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, engine: Engine, host: str, port: int, *, model_name: str, vocab: int,
                 request_timeout_s: float) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self.engine = engine
        self.model_name = model_name
        self.vocab = vocab
        self.request_timeout_s = request_timeout_s
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> "CompletionServer":
        self._thread = threading.Thread(target=self.serve_forever, name="http-api", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and release the socket; a stream in flight ends with the process."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()


def serve_http(engine: Engine, host: str = "127.0.0.1", port: int = 8001, *, model_name: str | None = None,
               request_timeout_s: float = 600.0) -> CompletionServer:
    """Bind host:port (0: a free port) and serve in a background thread; close() stops it."""
    cfg = getattr(engine, "cfg", None)
    name = model_name or (cfg.model if cfg is not None else "tiny")
    vocab = PRESETS[name].vocab if name in PRESETS else engine.tokenizer.vocab_size
    return CompletionServer(engine, host, port, model_name=name, vocab=vocab,
                            request_timeout_s=request_timeout_s).start()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CompletionServer
    server_version = "model-runner"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  # the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    # --- routing

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._json(HTTPStatus.OK, {"status": "ok", "model": self.server.model_name,
                                       **self.server.engine.health()})
        elif path == "/metrics":
            data = prometheus_client.generate_latest(self.server.engine.registry)
            self._send(HTTPStatus.OK, data, prometheus_client.CONTENT_TYPE_LATEST)
        elif path == "/v1/completions":
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST for /v1/completions")
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route for GET {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != "/v1/completions":
            self._error(HTTPStatus.NOT_FOUND, f"no route for POST {path}")
            return
        try:
            body = self._read_json()
            params = parse_completion(body, model_name=self.server.model_name, vocab=self.server.vocab,
                                      tokenizer=self.server.engine.tokenizer)
        except RequestError as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e), param=e.param)
            return
        self._complete(params)

    # --- completions

    def _complete(self, p: CompletionParams) -> None:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        req = GenerationRequest(prompt_ids=p.prompt_ids, max_tokens=p.max_tokens, temperature=p.temperature,
                                seed=p.seed, kv_cache_ttl_seconds=p.kv_cache_ttl_seconds, stop_ids=p.stop_ids,
                                request_id=request_id)
        try:
            handle = self.server.engine.submit(req)
        except ValueError as e:  # the engine's own limits (e.g. longer than the KV pool)
            self._error(HTTPStatus.BAD_REQUEST, str(e))
            return
        except Exception as e:  # noqa: BLE001  # an engine that is stopping or broken: the client learns why
            log.exception("submit failed")
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"engine unavailable: {e}", kind="server_error")
            return
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.server.model_name}
        if p.stream:
            self._stream(handle, head)
            return
        try:
            r = handle.result(timeout=self.server.request_timeout_s)
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", request_id)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"generation failed: {e}", kind="server_error")
            return
        text = self.server.engine.tokenizer.decode(r.output_ids)
        self._json(HTTPStatus.OK, {
            **head,
            "choices": [{"index": 0, "text": text, "finish_reason": r.finish_reason, "logprobs": None}],
            "usage": _usage(r), "token_ids": list(r.output_ids), "kv_cache": _kv_cache_ext(r)})

    def _stream(self, handle: Any, head: dict) -> None:
        chunked = self.request_version != "HTTP/1.0"
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Request-Id", head["id"])
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
        self.end_headers()

        def event(obj: Any) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data) if chunked else data)

        def chunk(text: str, token_ids: list[int], finish_reason: str | None, **extra: Any) -> dict:
            return {**head, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason,
                                         "logprobs": None}], "token_ids": token_ids, **extra}

        text = IncrementalText(self.server.engine.tokenizer)
        try:
            try:
                for tok in handle.stream():
                    event(chunk(text.push(tok), [tok], None))
                r = handle.result(timeout=self.server.request_timeout_s)
                event(chunk(text.flush(), [], r.finish_reason, usage=_usage(r), kv_cache=_kv_cache_ext(r)))
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as e:  # noqa: BLE001  # headers are out: report in-band, as OpenAI does
                log.exception("stream %s failed", head["id"])
                event({"error": {"message": f"generation failed: {e}", "type": "server_error"}})
            event("[DONE]")
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            # The engine has no cancel: the request runs to its end and its KV is cached as usual.
            log.info("client of %s went away mid-stream", head["id"])
            self.close_connection = True

    # --- plumbing

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            self.close_connection = True
            raise RequestError("a Content-Length header is required")
        n = int(length)
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(f"request body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(n)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None

    def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: HTTPStatus, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: HTTPStatus, message: str, *, kind: str = "invalid_request_error",
               param: str | None = None) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})
