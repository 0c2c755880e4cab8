"""The model-runner HTTP API against real processes: a kvservice daemon and `python -m model_runner` runners.

Runners use the tiny preset on the CPU (float32, 16 tokens a block, 8 KiB of KV a block). Each start imports
torch (seconds), so a module-wide daemon and runner serve the API tests, and the crash scenarios bring their
own daemon and runners. Requests are greedy unless a test says otherwise, so the same prompt must give the
same token ids whether its KV came from the GPU tier, the service or a recompute.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from harness.runner import ModelRunner
from model_runner.openai_protocol import (
    IncrementalText,
    RequestError,
    StopStrings,
    chat_prompt,
    parse_completion,
)
from model_runner.tokenizer import ByteTokenizer
from tests.daemon_kit import Daemon

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TOKENS = 16  # a tiny block holds 8 KiB of KV (float32)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 10.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def text_prompt(n_chars: int, salt: int) -> str:
    """Distinct ASCII text per salt from its first block on (one token a character, plus BOS)."""
    rng = random.Random(salt)
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n_chars))


class Runner(ModelRunner):
    """A `python -m model_runner` subprocess (harness.runner) of the tiny preset; the constructor returns
    once it prints its listening line."""

    def __init__(self, service: str, *args: str, timeout: float = 60.0) -> None:
        super().__init__(["--service", service, "--model", "tiny", *args])
        self.wait_ready(timeout)

    def post(self, body: dict | bytes, timeout: float = 60.0) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, _, raw = self.request("POST", "/v1/completions", data, {"Content-Type": "application/json"},
                                      timeout)
        return status, json.loads(raw)

    def complete(self, **body) -> dict:  # type: ignore[override]  # the whole body, not (prompt, max_tokens)
        status, reply = self.post(body)
        assert status == 200, reply
        return reply

    def stream(self, **body) -> list[dict | str]:
        """POST with stream=true; the decoded `data:` events, "[DONE]" kept as a string."""
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        events: list[dict | str] = []
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for raw in r:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                else:
                    assert line == "", f"not SSE: {line!r}"
        return events

    def health(self) -> dict:
        status, _, raw = self.request("GET", "/health", timeout=10)
        assert status == 200, raw
        return json.loads(raw)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_runners(service: str, *arg_lists: tuple[str, ...]) -> list[Runner]:
    """Start runners in parallel (each import of torch takes seconds)."""
    with ThreadPoolExecutor(len(arg_lists)) as ex:
        futures = [ex.submit(Runner, service, *args) for args in arg_lists]
    runners, errors = [], []
    for f in futures:
        try:
            runners.append(f.result())
        except Exception as e:  # noqa: BLE001  # close the ones that did start, then fail
            errors.append(e)
    if errors:
        for r in runners:
            r.close()
        raise errors[0]
    return runners


def tier(d: Daemon, name: str):
    return next(t for t in d.stats().tiers if t.name == name)


def session_clients(d: Daemon) -> list[str]:
    return [s.client_name for s in d.admin("ListSessions").sessions]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Daemon(host_capacity="1MiB", disk_capacity="4MiB") as d:
        yield d


@pytest.fixture(scope="module")
def runner(daemon: Daemon) -> Iterator[Runner]:
    (r,) = start_runners(daemon.target, ("--served-model-name", "tiny", "llama-alias"))
    try:
        yield r
        assert r.stop() == 0, r.log()
    finally:
        r.close()


# --- request parsing, without a server


def test_parse_completion_rejects_what_a_client_can_fix() -> None:
    tok = ByteTokenizer()

    def parse(**body):
        return parse_completion(body, model_name="tiny", vocab=512, tokenizer=tok)

    p = parse(prompt="hi", kv_cache_ttl_seconds=30, stop_token_ids=[65])
    assert p.prompt_ids == [tok.BOS, ord("h"), ord("i")] and p.max_tokens == 16 and p.temperature == 0.0
    assert p.kv_cache_ttl_seconds == 30.0 and p.stop_ids == (65, tok.EOS) and not p.stream
    assert parse(prompt="hi", ignore_eos=True).stop_ids == ()
    assert parse(prompt="hi", stop="\n").stop == ("\n",) and parse(prompt="hi", stop=["a", "bc"]).stop == ("a", "bc")
    assert parse(prompt=["hi"]).prompt_ids == p.prompt_ids  # a batch of one, as the openai client may send
    assert parse(prompt=[1, 2, 511], max_tokens=3, model="tiny").prompt_ids == [1, 2, 511]
    assert parse(prompt="").prompt_ids == [tok.BOS]  # unconditional generation
    for body, param in [({}, "prompt"), ({"prompt": []}, "prompt"),
                        ({"prompt": [1, 512]}, "prompt"), ({"prompt": [1, -1]}, "prompt"),
                        ({"prompt": [1, True]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                        ({"prompt": 5}, "prompt"), ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
                        ({"prompt": "x", "temperature": -0.1}, "temperature"),
                        ({"prompt": "x", "temperature": "hot"}, "temperature"),
                        ({"prompt": "x", "kv_cache_ttl_seconds": -1}, "kv_cache_ttl_seconds"),
                        ({"prompt": "x", "model": "8b"}, "model"), ({"prompt": "x", "seed": 1.5}, "seed"),
                        ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "n": 2}, "n"),
                        ({"prompt": "x", "stop": ["a"] * 5}, "stop"), ({"prompt": "x", "stop": 3}, "stop")]:
        with pytest.raises(RequestError) as e:
            parse(**body)
        assert e.value.param == param, body


def test_chat_template_and_stop_strings() -> None:
    assert chat_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]},
                        {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]) == (
        "<|system|>\nS\n<|user|>\nQ\n<|assistant|>\nA\n<|user|>\nQ2\n<|assistant|>\n")
    with pytest.raises(RequestError):
        chat_prompt([{"role": "robot", "content": "x"}])
    s = StopStrings(["END", "\n\n"])
    out = [s.push(c) for c in "abEN"]  # "EN" may start "END": held back
    assert "".join(out) == "ab" and not s.stopped
    assert s.push("X") == "ENX"  # it did not
    assert s.push("cE") == "c" and s.push("ND tail") == "" and s.stopped
    assert s.flush() == ""
    free = StopStrings(["zz"])
    assert free.push("az") == "a" and free.flush() == "z"


def test_incremental_text_holds_back_split_utf8() -> None:
    tok = ByteTokenizer()
    ids = [*"é€".encode(), 300, 257, *b"ok", 0xFF]  # multi-byte chars, non-byte ids, a stray invalid byte
    inc = IncrementalText(tok)
    deltas = [inc.push(i) for i in ids]
    assert deltas[0] == "" and deltas[1] == "é"  # the first byte of é alone is held back
    assert "".join(deltas) + inc.flush() == tok.decode(ids)


# --- (a) the API of one runner


def test_completion_from_text_and_from_token_ids(runner: Runner) -> None:
    prompt = text_prompt(40, salt=1)
    a = runner.complete(model="tiny", prompt=prompt, max_tokens=8)
    assert a["object"] == "text_completion" and a["model"] == "tiny" and a["id"].startswith("cmpl-")
    (choice,) = a["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("length", "stop") and choice["logprobs"] is None
    assert choice["text"] == ByteTokenizer().decode(a["token_ids"])
    usage = a["usage"]
    assert usage["prompt_tokens"] == len(prompt) + 1  # BOS first
    assert usage["completion_tokens"] == len(a["token_ids"]) <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert set(a["kv_cache"]["cached_tokens_by_tier"]) == {"gpu", "host", "disk"}
    assert a["kv_cache"]["ttft_ms"] > 0

    ids = ByteTokenizer().encode(prompt, add_bos=True)
    b = runner.complete(prompt=ids, max_tokens=8)
    assert b["token_ids"] == a["token_ids"]  # same ids, greedy: same output
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the GPU tier holds the prefix now
    assert b["kv_cache"]["cached_tokens_by_tier"]["gpu"] > 0 and b["kv_cache"]["kv_source"] == "gpu"


def test_stream_concatenates_to_the_plain_completion(runner: Runner) -> None:
    body = {"prompt": text_prompt(50, salt=2), "max_tokens": 12, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    plain = runner.complete(**body)
    events = runner.stream(**body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    token_ids = [t for c in chunks for t in c["token_ids"]]
    assert token_ids == plain["token_ids"] and len(token_ids) == 12
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    # Every token is visible text on its own: one non-empty chunk per token, then the finish.
    assert all(len(c["token_ids"]) == 1 and c["choices"][0]["text"] and c["choices"][0]["finish_reason"] is None
               for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "length"
    assert "kv_source" in last["kv_cache"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_seeded_sampling_is_reproducible(runner: Runner) -> None:
    body = {"prompt": text_prompt(20, salt=3), "max_tokens": 8, "temperature": 1.0, "seed": 1234}
    assert runner.complete(**body)["token_ids"] == runner.complete(**body)["token_ids"]


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "JSON"),
    (b"[1, 2]", "object"),
    (json.dumps({"max_tokens": 4}).encode(), "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "kv_cache_ttl_seconds": -5}).encode(), "kv_cache_ttl_seconds"),
    (json.dumps({"prompt": [1, 2, 100000]}).encode(), "vocabulary"),
    (json.dumps({"prompt": [65] * 5000}).encode(), "KV blocks"),  # over the 256-block pool: the engine says no
])
def test_invalid_requests_get_400_with_a_message(runner: Runner, body: bytes, needle: str) -> None:
    status, reply = runner.post(body)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error"
    assert needle in reply["error"]["message"]


# --- (a') the official openai client


def client_of(runner: Runner, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=runner.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def test_openai_client_completions_and_chat_streaming_and_not(runner: Runner) -> None:
    """Scenario: the official client, one keep-alive connection, completions and chat, streamed and not:
    the streamed text equals the plain text, usage arrives in the include_usage chunk, and the second
    ask of a prompt reports its cached tokens."""
    c = client_of(runner)
    prompt = text_prompt(60, salt=30)
    plain = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body={"ignore_eos": True})
    assert plain.object == "text_completion" and plain.choices[0].finish_reason == "length"
    assert len(plain.choices[0].text) == 10 and plain.usage.completion_tokens == 10
    pieces, usage = [], None
    for chunk in c.completions.create(model="tiny", prompt=prompt, max_tokens=10, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == plain.choices[0].text
    assert usage is not None and usage.completion_tokens == 10
    assert usage.prompt_tokens_details.cached_tokens >= BLOCK_TOKENS  # the GPU tier has the prompt now

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text_prompt(40, salt=31)}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content) == 8 and chat.choices[0].finish_reason == "length"
    deltas, roles, finish, usage = [], [], None, None
    for chunk in c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            d = chunk.choices[0].delta
            roles += [d.role] if d.role else []
            deltas += [d.content] if d.content else []
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert roles == ["assistant"] and "".join(deltas) == chat.choices[0].message.content and finish == "length"
    assert len(deltas) == 8  # every token a visible delta
    assert usage is not None and usage.prompt_tokens == chat.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_models_served_names_stop_strings_and_eos(runner: Runner) -> None:
    c = client_of(runner)
    assert [m.id for m in c.models.list().data] == ["tiny", "llama-alias"]
    prompt = text_prompt(30, salt=32)
    full = c.completions.create(model="llama-alias", prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True})
    assert full.model == "llama-alias"
    text = full.choices[0].text
    stop = text[5:7]
    cut = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 12
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x")
    # EOS is honoured: with token-id stops off and EOS on, generation ends at the model's EOS if it picks
    # one; across these prompts at least one answer ends early with finish_reason "stop" before max_tokens.
    reasons = [c.completions.create(model="tiny", prompt=text_prompt(20, salt=s), max_tokens=40).choices[0]
               for s in range(40, 52)]
    for r in reasons:
        assert r.finish_reason in ("stop", "length")
        assert (r.finish_reason == "stop") == (len(r.text) < 40)
    assert any(r.finish_reason == "stop" for r in reasons)


def test_keep_alive_requests_do_not_wait_for_nagle(runner: Runner) -> None:
    """Regression: small writes without TCP_NODELAY made every request on a reused connection wait out
    Nagle + the client's delayed ACK (~40 ms; 43.9 ms seen by a client vs 2.4 ms in the server). Measured
    against the same requests on fresh connections in the same run: reusing a connection must not be
    slower than opening one."""
    host, port = runner.url.removeprefix("http://").split(":")

    def timed(conn_factory, n: int = 15) -> float:
        times = []
        conn = conn_factory()
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 1}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200
            r.read()
            times.append(time.perf_counter() - t0)
            if conn_factory is fresh:
                conn.close()
                conn = conn_factory()
        conn.close()
        return sorted(times)[n // 2]

    def fresh() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(host, int(port), timeout=30)

    reused, new = timed(lambda: fresh()), timed(fresh)
    assert reused < 2 * new + 0.005, f"keep-alive p50 {reused * 1e3:.1f} ms vs fresh connections {new * 1e3:.1f} ms"


def test_unread_body_of_an_unknown_route_does_not_poison_the_connection(runner: Runner) -> None:
    """Regression: a POST to an unknown route was answered without reading its body, so the next request
    on that keep-alive connection was parsed from the leftover body (400/501)."""
    host, port = runner.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/engines/x/completions", json.dumps({"prompt": "POST / HTTP/1.1\r\n" * 200}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 404 and "no route" in json.loads(r.read())["error"]["message"]
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["object"] == "text_completion"
    finally:
        conn.close()


def test_unknown_routes_and_methods(runner: Runner) -> None:
    assert runner.request("GET", "/v1/nothing")[0] == 404
    assert runner.request("GET", "/v1/completions")[0] == 405
    assert runner.request("POST", "/health", b"{}")[0] == 405


def test_health_and_metrics(runner: Runner) -> None:
    runner.complete(prompt=text_prompt(10, salt=4), max_tokens=2)
    h = runner.health()
    assert h["status"] == "ok" and h["model"] == "tiny" and h["service_attached"] is True
    assert {"running", "waiting", "parked"} <= h.keys()
    status, headers, raw = runner.request("GET", "/metrics")
    content_type = {k.lower(): v for k, v in headers.items()}["content-type"]
    assert status == 200 and content_type.startswith("text/plain; version=")
    text = raw.decode()
    ttft = [line for line in text.splitlines() if "ttft" in line and "_bucket" in line]
    assert ttft, text
    count = [line for line in text.splitlines() if "ttft" in line and line.split()[0].endswith("_count")]
    assert count and float(count[0].split()[-1]) > 0


def test_keep_alive_serves_several_requests_on_one_connection(runner: Runner) -> None:
    host, port = runner.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for _ in range(2):
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 2}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] <= 2
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_concurrent_requests_match_sequential_ones(runner: Runner) -> None:
    """Scenario: four clients at once (one handler thread each, interleaved in the engine) get what each
    would have got alone."""
    bodies = [{"prompt": text_prompt(30 + 10 * i, salt=20 + i), "max_tokens": 6} for i in range(4)]
    alone = [runner.complete(**b)["token_ids"] for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as ex:
        together = list(ex.map(lambda b: runner.complete(**b)["token_ids"], bodies))
    assert together == alone


def test_client_that_leaves_mid_stream_does_not_hurt_the_server(runner: Runner) -> None:
    host, port = runner.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 100, "stream": True}))
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    conn.close()  # mid-stream
    assert runner.complete(prompt="abc", max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3


# --- (e) the per-request TTL reaches the daemon


def test_kv_cache_ttl_reaches_the_daemon(daemon: Daemon, runner: Runner) -> None:
    """Scenario: a request asks for 1h retention; the daemon then holds retained blocks of its prompt."""
    assert sum(t.retained_blocks for t in daemon.stats().tiers) == 0
    runner.complete(prompt=text_prompt(100, salt=5), max_tokens=2, kv_cache_ttl_seconds=3600)
    wait_for("retained blocks on the daemon", lambda: sum(t.retained_blocks for t in daemon.stats().tiers) > 0)


# --- (b) a second runner reuses the first one's prefix through the daemon


def test_second_runner_reuses_the_prefix_through_the_daemon(daemon: Daemon, runner: Runner) -> None:
    """Scenario: runner A computes a prompt and offloads its blocks; runner B, cold, loads them from the
    daemon instead of recomputing, and produces the same greedy tokens."""
    prompt = text_prompt(200, salt=6)
    stores_before = daemon.stats().counters.stores
    first = runner.complete(prompt=prompt, max_tokens=10)
    assert first["kv_cache"]["kv_source"] == "none"
    full_blocks = (len(prompt) + 1) // BLOCK_TOKENS
    wait_for("the prompt's blocks stored", lambda: daemon.stats().counters.stores >= stores_before + full_blocks)

    (second,) = start_runners(daemon.target, ("--load-policy", "always"))
    try:
        again = second.complete(prompt=prompt, max_tokens=10)
        assert again["token_ids"] == first["token_ids"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        tiers = again["kv_cache"]["cached_tokens_by_tier"]
        assert tiers["host"] + tiers["disk"] > 0 and tiers["gpu"] == 0
        assert again["kv_cache"]["kv_source"] == "loaded"
        assert second.stop() == 0, second.log()
    finally:
        second.close()


# --- (c) the daemon crashes and comes back


def test_runner_recomputes_while_the_daemon_is_down_and_reattaches() -> None:
    """Scenario: the daemon is SIGKILLed with a request in flight; the runner keeps answering (the prompt
    that left its GPU tier is recomputed, same tokens), /health stays 200 with service_attached false, and
    once the daemon is back the runner re-attaches by itself and offloads again."""
    d = Daemon(host_capacity="1MiB", disk_capacity="4MiB").start()
    try:
        # A 24-block GPU tier: three more 7-block prompts push the first one out of it.
        (r,) = start_runners(d.target, ("--gpu-blocks", "24", "--load-policy", "always"))
        try:
            x = text_prompt(100, salt=7)
            before = r.complete(prompt=x, max_tokens=8)
            for salt in (8, 9, 10):
                r.complete(prompt=text_prompt(100, salt=salt), max_tokens=4)
            assert r.health()["service_attached"] is True

            with ThreadPoolExecutor(1) as ex:
                in_flight = ex.submit(r.complete, prompt=text_prompt(20, salt=11), max_tokens=200)
                d.kill9()
                assert in_flight.result(timeout=60)["usage"]["completion_tokens"] > 0

            during = r.complete(prompt=x, max_tokens=8)
            assert during["token_ids"] == before["token_ids"]
            assert during["kv_cache"]["kv_source"] == "recomputed:service-down"
            assert during["kv_cache"]["cached_tokens_by_tier"] == {"gpu": 0, "host": 0, "disk": 0}
            wait_for("service_attached false", lambda: r.health()["service_attached"] is False, timeout=15)

            d.start()
            wait_for("service_attached true", lambda: r.health()["service_attached"] is True, timeout=30,
                     every=0.25)
            stores = d.stats().counters.stores
            r.complete(prompt=text_prompt(100, salt=12), max_tokens=2)
            wait_for("stores to the restarted daemon", lambda: d.stats().counters.stores > stores)
            assert r.stop() == 0, r.log()
        finally:
            r.close()
    finally:
        d.close()


# --- (d) a runner is SIGKILLed while its load is in flight


def test_runner_killed_mid_load_leaves_the_daemon_and_the_other_runner_fine() -> None:
    """Scenario: runner A stores prompt P (32 blocks, the whole host tier of 256 KiB), then prompt Q, which
    pushes P to disk; runner B asks for P with disk reads throttled to 64 KiB/s (a 4 s load) and is SIGKILLed
    while parked on that load. The daemon drops B's session within a few seconds, and A still serves P with
    the same tokens."""
    d = Daemon(host_capacity="256KiB", disk_capacity="8MiB")
    help_text = subprocess.run([sys.executable, "-m", "kvservice", "serve", "--help"], capture_output=True,
                               text=True, env=d.env, cwd=str(ROOT)).stdout
    if "--disk-read-bytes-per-second" not in help_text:
        d.close()
        pytest.skip("kvservice serve has no --disk-read-bytes-per-second")
    d.args += ["--disk-read-bytes-per-second", "64KiB"]
    d.start()
    try:
        a, b = start_runners(d.target, (), ("--load-policy", "always"))
        try:
            # 512 tokens = 32 blocks each. A Store is cut to what the host tier can take, so a prompt
            # longer than the host tier would reach the daemon only in part.
            p, q = text_prompt(511, salt=13), text_prompt(511, salt=14)
            first = a.complete(prompt=p, max_tokens=8)
            wait_for("P stored", lambda: d.stats().counters.stores >= 31)
            a.complete(prompt=q, max_tokens=2)
            wait_for("P spilled to disk", lambda: tier(d, "disk").blocks >= 31 and d.stats().write_queue_depth == 0)
            assert f"model-runner[{b.pid}]" in session_clients(d)

            with ThreadPoolExecutor(1) as ex:
                doomed = ex.submit(b.post, {"prompt": p, "max_tokens": 8}, 60)
                wait_for("B parked on its load", lambda: b.health()["parked"] >= 1, timeout=10, every=0.02)
                b.kill9()
                with pytest.raises((ConnectionError, http.client.HTTPException, urllib.error.URLError)):
                    doomed.result(timeout=30)

            wait_for("B's session reclaimed", lambda: f"model-runner[{b.pid}]" not in session_clients(d),
                     timeout=15, every=0.2)
            assert session_clients(d) == [f"model-runner[{a.pid}]"]
            assert a.complete(prompt=p, max_tokens=8)["token_ids"] == first["token_ids"]
            assert a.health()["service_attached"] is True
            stores = d.stats().counters.stores
            a.complete(prompt=text_prompt(100, salt=15), max_tokens=2)
            wait_for("A's next stores", lambda: d.stats().counters.stores > stores)
            assert a.stop() == 0, a.log()
        finally:
            a.close()
            b.close()
    finally:
        d.close()


# --- the CLI


def test_cli_help_and_bad_flags_fail_fast() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "model_runner", "--help"], capture_output=True, text=True,
                         env=env, cwd=str(ROOT), timeout=30)
    assert out.returncode == 0 and "--load-policy" in out.stdout and "--no-write-through" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "model_runner", "--gpu-blocks", "0"], capture_output=True,
                         text=True, env=env, cwd=str(ROOT), timeout=30)
    assert bad.returncode == 2 and "--gpu-blocks" in bad.stderr


def test_sigint_stops_a_runner_cleanly_without_a_service() -> None:
    (r,) = start_runners("", ())
    try:
        assert r.complete(prompt="hello", max_tokens=3)["kv_cache"]["kv_source"] == "none"
        assert r.health()["service_attached"] is False
        assert r.stop(signal.SIGINT) == 0, r.log()
    finally:
        r.close()
