"""The OpenAI wire format of the reference engine, without a server: request validation, the chat
template, incremental text with stop strings, and the response / stream-chunk bodies.

Chat template (over the byte tokenizer; BOS first, then one block per message, then the
assistant's header for the reply):

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

A message's content is a string or a list of {"type": "text", "text": ...} parts (joined). Roles:
system, developer (shown as system), user, assistant. A text completion prompt is encoded with BOS
first, as Llama-style servers do; a token-id prompt is taken as given.

Extensions beyond OpenAI's fields: request `kv_cache_ttl_seconds` (retain the prompt's KV on the
service that long), `stop_token_ids`, `ignore_eos`; response `kv_cache` (cached tokens per tier,
kv_source, ttft_ms, total_ms, timings: where the request's time went inside the engine) and, on completions, `token_ids`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model_runner.requests import GenerationResult

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(ValueError):
    """A client error: answered 400 with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """A validated /v1/completions or /v1/chat/completions body."""

    model: str  # the served name the client asked for (echoed back)
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool  # stream_options.include_usage
    kv_cache_ttl_seconds: float
    stop_ids: tuple[int, ...]  # stop_token_ids, plus EOS unless ignore_eos
    stop: tuple[str, ...]  # stop strings
    chat: bool


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


def _bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be a boolean", key)
    return v


def chat_prompt(messages: Any) -> str:
    """The documented template (module docstring) applied to a messages list."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise RequestError(f"each message needs a role in {sorted(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError("message content parts must be {'type': 'text', 'text': str}", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError("message content must be a string or a list of text parts", "messages")
        out.append(f"<|{CHAT_ROLES[m['role']]}|>\n{content}\n")
    return "".join(out) + "<|assistant|>\n"


def parse_request(body: Any, *, chat: bool, served_names: Sequence[str], vocab: int, tokenizer: Any
                  ) -> CompletionParams:
    """Validate a decoded JSON body; raises RequestError with a message a client can act on."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = served_names[0]
    if model not in served_names:
        raise RequestError(f"model '{model}' is not served here; this server serves {list(served_names)}",
                           "model", status=404)

    if chat:
        prompt_ids = tokenizer.encode(chat_prompt(body.get("messages")), add_bos=True)
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise RequestError("'prompt' is required", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one, as the openai client sends a list prompt
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_bos=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise RequestError("batched prompts are not supported; send one prompt per request", "prompt")
        else:
            prompt_ids = _token_ids(prompt, "prompt", vocab)
        if not prompt_ids:
            raise RequestError("'prompt' must not be empty", "prompt")

    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError(f"'{key}' must be a positive integer", key)

    temperature = _number(body, "temperature", 0.0)
    if temperature < 0:
        raise RequestError("'temperature' must be >= 0", "temperature")
    ttl = _number(body, "kv_cache_ttl_seconds", 0.0)
    if ttl < 0:
        raise RequestError("'kv_cache_ttl_seconds' must be >= 0", "kv_cache_ttl_seconds")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError("'seed' must be an integer", "seed")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError("only n=1 is supported", "n")

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", vocab)
    if not _bool(body, "ignore_eos"):
        stop_ids.append(tokenizer.EOS)
    return CompletionParams(model=model, prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=temperature,
                            seed=seed, stream=stream, include_usage=include_usage, kv_cache_ttl_seconds=ttl,
                            stop_ids=tuple(dict.fromkeys(stop_ids)), stop=tuple(s for s in stop if s), chat=chat)


def parse_completion(body: Any, *, model_name: str, vocab: int, tokenizer: Any) -> CompletionParams:
    """parse_request for /v1/completions with one served name (kept for callers of the old API)."""
    return parse_request(body, chat=False, served_names=[model_name], vocab=vocab, tokenizer=tokenizer)


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


class StopStrings:
    """Text deltas in, text deltas out, ending at the first stop string (which is not sent).

    Up to len(longest stop) - 1 trailing characters are held back while they could still be the start
    of a stop string; flush() releases them when generation ends without one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        text = self._pending + delta
        if not self._stops:
            self._pending = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        keep = 0
        for k in range(min(self._hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self._stops):
                keep = k
                break
        self._pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


# --- response bodies


def kv_cache_ext(r: GenerationResult) -> dict:
    tiers = {t: int(r.cached_by_tier.get(t, 0)) for t in ("gpu", "host", "disk")}
    return {"cached_tokens_by_tier": tiers, "kv_source": r.kv_source,
            "ttft_ms": round(r.ttft_s * 1e3, 3), "total_ms": round(r.total_s * 1e3, 3), "timings": r.timings}


def usage(r: GenerationResult, completion_tokens: int | None = None) -> dict:
    completion = len(r.output_ids) if completion_tokens is None else completion_tokens
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": completion,
            "total_tokens": r.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def head(request_id: str, model: str, chat: bool, stream: bool) -> dict:
    obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model}


def choice(chat: bool, stream: bool, text: str | None, finish_reason: str | None, *, role: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if stream:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": text or ""}, "logprobs": None,
            "finish_reason": finish_reason}
