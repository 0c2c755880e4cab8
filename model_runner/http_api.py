"""OpenAI-compatible HTTP front of the reference engine, on FastAPI + uvicorn.

    server = serve_http(engine, "127.0.0.1", 8001, served_names=["tiny", "llama"])  # serving in a thread
    server.url                                       # "http://127.0.0.1:8001" (the real port for port 0)
    server.close()                                   # stop accepting, finish, release the socket

Routes:
- POST /v1/completions, POST /v1/chat/completions: OpenAI's bodies and answers, streamed as OpenAI
  streams them (Server-Sent Events, `data: [DONE]`; with stream_options.include_usage every chunk has
  "usage": null and a last chunk with no choices carries the usage). Wire format, chat template and
  extensions (kv_cache_ttl_seconds, stop_token_ids, ignore_eos, kv_cache, token_ids): openai_protocol.py.
  Stop strings end the answer (not included); EOS ends it unless ignore_eos. usage.prompt_tokens_details
  .cached_tokens counts the prompt tokens whose KV was reused (GPU tier or loaded from the service).
- GET /v1/models: the served names (--served-model-name), all the same model.
- GET /health: 200 {"status": "ok", "model", **engine.health()}; still 200 while the service is detached,
  since the engine keeps serving by recomputing (`service_attached` says which).
- GET /metrics: the engine's Prometheus registry.

The engine runs on its own thread; a request hands it a listener that forwards tokens to the request's
asyncio queue (call_soon_threadsafe), so no thread waits per request. A client that goes away, or a stop
string, cancels the request in the engine. The listening socket is made here (HTTPServer) so that
asyncio sets TCP_NODELAY on every connection; h11 reads (or discards) each request body before it
parses the next request on a connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from model_runner.config import PRESETS
from model_runner.engine import Engine
from model_runner.openai_protocol import (
    CompletionParams,
    IncrementalText,
    RequestError,
    StopStrings,
    choice,
    head,
    kv_cache_ext,
    parse_completion,
    parse_request,
    usage,
)
from model_runner.requests import GenerationRequest, GenerationResult

__all__ = ["HTTPServer", "IncrementalText", "RequestError", "build_app", "parse_completion", "serve_http"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20


def _error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None
           ) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


class _Generation:
    """One request in the engine, read from the event loop: text deltas with stop strings applied."""

    def __init__(self, engine: Engine, p: CompletionParams, request_id: str, timeout_s: float) -> None:
        self.p = p
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int | None, GenerationResult | None, BaseException | None]] = (
            asyncio.Queue())
        self._deadline = time.monotonic() + timeout_s
        self._text = IncrementalText(engine.tokenizer)
        self._stops = StopStrings(p.stop)
        self.tokens = 0  # output tokens that went into the answer
        self.result: GenerationResult | None = None
        req = GenerationRequest(prompt_ids=p.prompt_ids, max_tokens=p.max_tokens, temperature=p.temperature,
                                seed=p.seed, kv_cache_ttl_seconds=p.kv_cache_ttl_seconds, stop_ids=p.stop_ids,
                                request_id=request_id)
        self.handle = engine.submit(req, self._listen)

    def _listen(self, token: int | None, result: GenerationResult | None, err: BaseException | None) -> None:
        try:  # runs on the engine's loop thread
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (token, result, err))
        except RuntimeError:  # the server's event loop is gone (shutdown): nobody is listening
            pass

    async def deltas(self) -> AsyncIterator[tuple[int | None, str]]:
        """(token id, text delta) per output token, then (None, the held-back tail); sets self.result."""
        while True:
            remaining = self._deadline - time.monotonic()
            try:
                token, result, err = await asyncio.wait_for(self._queue.get(), max(remaining, 0.001))
            except asyncio.TimeoutError:
                self.handle.cancel()
                raise TimeoutError("the request did not finish in time") from None
            if err is not None:
                raise err
            if result is not None:
                self.result = result
                yield None, self._stops.push(self._text.flush()) + self._stops.flush()
                return
            assert token is not None
            self.tokens += 1
            delta = self._stops.push(self._text.push(token))
            yield token, delta
            if self._stops.stopped:
                self.handle.cancel()
                await self._drain()
                yield None, ""
                return

    async def _drain(self) -> None:
        while self.result is None:
            token, result, err = await asyncio.wait_for(self._queue.get(), max(self._deadline - time.monotonic(),
                                                                               0.001))
            if err is not None:
                raise err
            self.result = result

    @property
    def finish_reason(self) -> str:
        if self._stops.stopped:
            return "stop"
        assert self.result is not None
        return "stop" if self.result.finish_reason in ("stop", "abort") else self.result.finish_reason


def build_app(engine: Engine, served_names: Sequence[str], *, vocab: int, request_timeout_s: float = 600.0
              ) -> FastAPI:
    names = list(served_names)
    app = FastAPI(title="model-runner", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        what = f"no route for {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, what)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": names[0], **engine.health()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus_client.generate_latest(engine.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        root = engine.cfg.model
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created,
                                            "owned_by": "model-runner", "root": root, "parent": None}
                                           for n in names]}

    async def generate(request: Request, chat: bool) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = await request.body()
        try:
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from None
            p = parse_request(body, chat=chat, served_names=names, vocab=vocab, tokenizer=engine.tokenizer)
        except RequestError as e:
            return _error(e.status, str(e), param=e.param)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            gen = _Generation(engine, p, request_id, request_timeout_s)
        except ValueError as e:  # the engine's own limits (e.g. longer than the KV pool)
            return _error(400, str(e))
        except Exception as e:  # noqa: BLE001  # an engine that is stopping or broken: the client learns why
            log.exception("submit failed")
            return _error(503, f"engine unavailable: {e}", kind="server_error")
        if p.stream:
            return StreamingResponse(_stream(gen, request_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        try:
            parts, ids = [], []
            async for tok, delta in gen.deltas():
                parts.append(delta)
                if tok is not None:
                    ids.append(tok)
        except Exception as e:  # noqa: BLE001
            gen.handle.cancel()
            log.exception("request %s failed", request_id)
            return _error(500, f"generation failed: {e}", kind="server_error")
        assert gen.result is not None
        out = {**head(request_id, p.model, chat, False),
               "choices": [choice(chat, False, "".join(parts), gen.finish_reason)],
               "usage": usage(gen.result, gen.tokens), "kv_cache": kv_cache_ext(gen.result)}
        if not chat:
            out["token_ids"] = ids
        return JSONResponse(out)

    async def _stream(gen: _Generation, request_id: str) -> AsyncIterator[bytes]:
        p = gen.p
        top = head(request_id, p.model, p.chat, True)
        extra = {"usage": None} if p.include_usage else {}

        def event(obj: Any) -> bytes:
            return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()

        try:
            if p.chat:
                yield event({**top, "choices": [choice(True, True, "", None, role=True)], **extra})
            try:
                tail = ""
                async for tok, delta in gen.deltas():
                    if tok is None:
                        tail += delta  # the end: what was held back (a split UTF-8 character, a stop's prefix)
                        continue
                    if not delta:
                        continue  # held back for now
                    chunk = {**top, "choices": [choice(p.chat, True, delta, None)], **extra}
                    if not p.chat:
                        chunk["token_ids"] = [tok]
                    yield event(chunk)
                assert gen.result is not None
                last = {**top, "choices": [choice(p.chat, True, tail if tail or not p.chat else None,
                                                  gen.finish_reason)], **extra, "kv_cache": kv_cache_ext(gen.result)}
                if not p.chat:
                    last["token_ids"] = []
                yield event(last)
                if p.include_usage:
                    yield event({**top, "choices": [], "usage": usage(gen.result, gen.tokens)})
            except Exception as e:  # noqa: BLE001  # headers are out: report in-band, as OpenAI does
                log.exception("stream %s failed", request_id)
                yield event({"error": {"message": f"generation failed: {e}", "type": "server_error"}})
            yield event("[DONE]")
        finally:
            if gen.result is None:  # the client went away: stop generating for it
                gen.handle.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


class HTTPServer:
    """uvicorn serving an app on a socket bound here, in a background thread."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP,
        # and without it a keep-alive client waits out Nagle + delayed ACK (~40 ms) on every response.
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=75, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="http-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> HTTPServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        """Stop accepting and release the socket; streams in flight get a few seconds to end."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(15)
        self._sock.close()


def serve_http(engine: Engine, host: str = "127.0.0.1", port: int = 8001, *,
               served_names: Sequence[str] | None = None, model_name: str | None = None,
               request_timeout_s: float = 600.0) -> HTTPServer:
    """Bind host:port (0: a free port) and serve in a background thread; close() stops it.
    served_names: the model names clients may ask for (the first is the default); default the preset's."""
    cfg = getattr(engine, "cfg", None)
    names = list(served_names or [model_name or (cfg.model if cfg is not None else "tiny")])
    vocab = PRESETS[cfg.model].vocab if cfg is not None and cfg.model in PRESETS else engine.tokenizer.vocab_size
    app = build_app(engine, names, vocab=vocab, request_timeout_s=request_timeout_s)
    return HTTPServer(app, host, port).start()
