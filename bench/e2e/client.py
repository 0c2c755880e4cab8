"""One streamed /v1/completions request, timed as a client sees it (request sent -> first token)."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field


@dataclass
class Reply:
    ok: bool
    error: str = ""
    t_send: float = 0.0  # monotonic
    ttft_ms: float | None = None
    total_ms: float | None = None
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    kv_source: str = ""
    engine_ttft_ms: float | None = None
    timings: dict = field(default_factory=dict)  # the engine's kv_cache.timings: queued, loading, to_first, plan

    def record(self, **kw: object) -> dict:
        return {"ok": self.ok, "error": self.error, "ttft_ms": self.ttft_ms, "total_ms": self.total_ms,
                "engine_ttft_ms": self.engine_ttft_ms, "prompt_tokens": self.prompt_tokens,
                "output_tokens": len(self.output_ids), "cached_tokens": self.cached_tokens, "by_tier": self.by_tier,
                "kv_source": self.kv_source, "timings": self.timings, **kw}


def host_port(url: str) -> tuple[str, int]:
    hp = url.removeprefix("http://").rstrip("/")
    host, port = hp.rsplit(":", 1)
    return host.strip("[]"), int(port)


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float) -> Reply:
    """Greedy, ignore_eos (fixed answer lengths), include_usage; the kv_cache extension of the last chunk."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    t0 = time.monotonic()
    rep = Reply(ok=False, t_send=t0)
    host, port = host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=max(1.0, timeout))
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            rep.error = f"HTTP {r.status}: {r.read()[:300]!r}"
            return rep
        usage = kv = None
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                rep.error = str(obj["error"].get("message", obj["error"]))[:300]
                return rep
            ids = obj.get("token_ids") or []
            if obj.get("choices") and obj["choices"][0].get("text") and rep.ttft_ms is None:
                rep.ttft_ms = (time.monotonic() - t0) * 1e3
            rep.output_ids.extend(ids)
            if obj.get("kv_cache"):
                kv = obj["kv_cache"]
            if obj.get("usage"):
                usage = obj["usage"]
        rep.total_ms = (time.monotonic() - t0) * 1e3
        if usage is None or kv is None:
            rep.error = "stream ended without usage / kv_cache"
            return rep
        rep.prompt_tokens = usage.get("prompt_tokens", len(prompt))
        rep.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rep.by_tier = {k: int(v) for k, v in (kv.get("cached_tokens_by_tier") or {}).items()}
        rep.kv_source = kv.get("kv_source", "")
        rep.engine_ttft_ms = kv.get("ttft_ms")
        rep.timings = dict(kv.get("timings") or {})
        if rep.ttft_ms is None:
            rep.error = "no visible text streamed"
            return rep
        rep.ok = True
        return rep
    except Exception as e:  # noqa: BLE001
        rep.error = f"{type(e).__name__}: {e}"[:300]
        return rep
    finally:
        conn.close()
