"""Slow clients are timed out on a real server: a stream whose client never reads is abandoned after
--stream-timeout and its requests aborted (the choices still queued behind it included); headers trickled a byte at
a time close the connection after --request-timeout, a trickled body gets a 408. After each the server is idle (no
request left, every KV block free) and a concurrent greedy canary answers exactly what it answers alone."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, canary, metric, wait_idle

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def strict_server(tiny_model: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """One request running at a time (a group's choices run one after another), and one-second client timeouts."""
    # One kernel thread: on a machine whose cores are busy elsewhere, a second one waiting on a busy core makes each
    # step ten times slower.
    proc = ServerProcess(str(tiny_model), "--kv-cache-bytes", str(16 << 20), "--max-num-seqs", "1", "--threads", "1",
                         "--stream-timeout", str(TIMEOUT_S), "--request-timeout", str(TIMEOUT_S), log_dir=server_logs)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def alone(strict_server: ServerProcess) -> str:
    return canary(strict_server)


def _connect(server: ServerProcess) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window, filled at once
    sock.connect((host, int(port)))
    return sock


def _request(body: dict, content_length: int | None = None) -> tuple[bytes, bytes]:
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length or len(payload)}\r\n\r\n").encode()
    return head, payload


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sent, up to the connection's end (a reset counts as the end)."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _finished(server: ServerProcess, reason: str) -> float:
    return metric(server, f'nextoken_requests_finished_total{{reason="{reason}"}}')


def _canary_beside(server: ServerProcess) -> tuple[threading.Thread, list[str]]:
    """The canary sent from a thread while the fault is under way; join, then read its text."""
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(canary(server)))
    thread.start()
    return thread, result


def test_a_stream_never_read_is_abandoned_and_its_requests_aborted(strict_server: ServerProcess, alone: str) -> None:
    server = strict_server
    wait_idle(server)
    aborted = _finished(server, "abort")
    # 16 choices of 1000 tokens with logprobs (about 1 kB an event), one at a time: 16 MB, far more than the socket
    # buffers hold (4 MB at most here), and seconds of work, so the stream's send blocks while choices are queued.
    body = {"model": server.model, "prompt": "a", "max_tokens": 1000, "n": 16, "logprobs": 20, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sock = _connect(server)
    try:
        head, payload = _request(body)
        sock.sendall(head + payload)
        deadline = time.monotonic() + 30
        while metric(server, "nextoken_requests_running") == 0:
            assert time.monotonic() < deadline, "the stream's requests never started"
            time.sleep(0.02)
        thread, result = _canary_beside(server)
        wait_idle(server, timeout=60)
        thread.join(60)
        # The choices that had not finished were aborted, not run to their end.
        assert _finished(server, "abort") - aborted >= 1
        received = _read_all(sock, timeout=10)
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200") and b"data: " in received and b"[DONE]" not in received
    assert result == [alone]
    assert "read nothing for 1 s" in server.log.read_text()


def test_trickled_headers_close_the_connection(strict_server: ServerProcess, alone: str) -> None:
    server = strict_server
    head, _ = _request({"model": server.model, "prompt": "hi"})
    sock = _connect(server)
    try:
        start = time.monotonic()
        sock.settimeout(0.1)  # one header byte every 0.1 s, until the server closes the connection
        closed = False
        for byte in head * 10:
            try:
                sock.sendall(bytes([byte]))
                closed = sock.recv(1024) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
        elapsed = time.monotonic() - start
    finally:
        sock.close()
    assert closed and TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 5
    assert canary(server) == alone


def test_a_connection_that_sends_nothing_is_closed(strict_server: ServerProcess) -> None:
    sock = _connect(strict_server)
    try:
        start = time.monotonic()
        assert _read_all(sock, timeout=TIMEOUT_S + 5) == b""
        assert time.monotonic() - start >= TIMEOUT_S * 0.9
    finally:
        sock.close()


def test_a_trickled_body_is_408(strict_server: ServerProcess, alone: str) -> None:
    server = strict_server
    head, payload = _request({"model": server.model, "prompt": "hi", "max_tokens": 4})
    sock = _connect(server)
    try:
        sock.sendall(head)
        sock.settimeout(0.1)
        answer = b""
        for byte in payload:  # one body byte every 0.1 s: the whole body would take seconds
            sock.sendall(bytes([byte]))
            try:
                answer = sock.recv(1 << 16)
                break
            except TimeoutError:
                continue
        answer += _read_all(sock, timeout=5)
    finally:
        sock.close()
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", answer[:200]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert "did not arrive within 1 s" in error["message"]
    wait_idle(server)
    assert canary(server) == alone
