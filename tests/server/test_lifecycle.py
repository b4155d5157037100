"""Requests that end early and servers that stop: a client leaving mid-stream or while waiting for a whole answer
gets its request aborted and its KV blocks freed; SIGTERM drains (the stream in flight completes, new requests get
503, exit code 0); binding beyond loopback without an API key is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ROOT, TINY_CONTEXT, ServerProcess, assert_sigterm_drains, metric, wait_idle

LONG = {"max_tokens": 600, "temperature": 0, "ignore_eos": True}  # 0.3 s or more on the tiny model


def test_client_leaving_mid_stream_frees_its_blocks(server: ServerProcess) -> None:
    wait_idle(server)
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert len(received) >= 3 and json.loads(received[0][6:])["choices"][0]["delta"]["role"] == "assistant"
        assert metric(server, "nextoken_requests_running") == 1
        assert metric(server, "nextoken_kv_blocks_used") > 0
    # The connection is closed: the server aborts the request well before its 600 tokens.
    wait_idle(server, timeout=5)
    assert metric(server, 'nextoken_http_requests_total{code="200",route="/v1/chat/completions"}') >= 1


def test_client_leaving_a_non_streaming_request_aborts_it(server: ServerProcess) -> None:
    wait_idle(server)
    before = metric(server, "nextoken_generation_tokens_total")
    # As many tokens as the context holds (the tiny model draws 600 in under 0.4 s on 2 Zen 4 cores); the client
    # waits 0.1 s for its answer.
    body = {"model": server.model, "prompt": "the cat", **LONG, "max_tokens": TINY_CONTEXT - 16}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    wait_idle(server, timeout=5)
    assert metric(server, "nextoken_generation_tokens_total") - before < body["max_tokens"]
    assert metric(server, 'nextoken_http_requests_total{code="499",route="/v1/completions"}') >= 1


def test_sigterm_drains_then_exits_zero(tiny_model: Path, spawn_server: Callable[..., ServerProcess]) -> None:
    proc = spawn_server(str(tiny_model), "--kv-cache-bytes", str(16 << 20), "--drain-timeout", "20")
    assert_sigterm_drains(proc, LONG["max_tokens"])


def test_non_loopback_bind_needs_a_key_or_an_explicit_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "nextoken", "serve", "--host", "0.0.0.0", "--port", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--allow-insecure-bind" in out.stderr and "Traceback" not in out.stderr


def test_sigint_ends_a_stream_in_flight_at_once(tiny_model: Path, spawn_server: Callable[..., ServerProcess]) -> None:
    # Its engine requests are ended before uvicorn waits for connections to close: the stream gets an error event
    # and [DONE] instead of being cut after uvicorn's 10 s grace period (with a traceback in the log).
    proc = spawn_server(str(tiny_model), "--kv-cache-bytes", str(16 << 20), "--max-num-seqs", "1", "--threads", "1")
    body = {"model": proc.model, "prompt": "a", "stream": True, "n": 16, **LONG, "max_tokens": 1000}  # a minute
    with httpx.Client(timeout=30) as http, http.stream("POST", proc.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGINT)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    proc.proc.wait(20)
    assert time.monotonic() - start < 10
    assert events[-1] == "[DONE]" and "shut down" in json.loads(events[-2])["error"]["message"]
    assert "Traceback" not in proc.log.read_text()
