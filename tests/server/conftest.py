"""Real `python -m nextoken serve` processes on 127.0.0.1 for the server tests, always cleaned up.

The tiny generated Llama (random weights, a 1024-token context so some requests can run for a second or two) keeps
them fast; `ServerProcess` reads the URL the server prints when ready. Every process is stopped by the finalizer of
the fixture that started it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.tiny import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-7f3a"
TINY_CONTEXT = 1024
_READY = re.compile(r"serving (\S+) at (http://\S+)/v1")


class ServerProcess:
    """One server subprocess: `url`, `model` (the served id), `log` (its stderr), `stop()`."""

    def __init__(self, model: str, *args: str, log_dir: Path, wait: bool = True) -> None:
        self.log = log_dir / f"server-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "nextoken", "serve", "--model", model, "--port", "0", "--device", "cpu",
               "--dtype", "float32", *args]
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until the server prints its URL (it binds port 0: the OS picks a free port)."""
        deadline = time.monotonic() + timeout
        line = ""
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break  # the process exited: its log says why
            if match := _READY.search(line):
                self.model, self.url = match.group(1), match.group(2)
                return
        self.stop()
        raise RuntimeError(f"server did not start: {line!r}\n{self.log.read_text()[-3000:]}")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # stop now: tests that drain send SIGTERM themselves
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("server-model") / "tiny-llama.gguf"
    return write_tiny_model(path, "llama", overrides={"llama.context_length": ("uint32", TINY_CONTEXT)})


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture
def spawn_server(server_logs: Path) -> Iterator[Callable[..., ServerProcess]]:
    """A factory for servers of one test (args as on the command line); all are stopped when it ends."""
    started: list[ServerProcess] = []

    def spawn(model: str, *args: str) -> ServerProcess:
        started.append(ServerProcess(model, *args, log_dir=server_logs))
        return started[-1]

    yield spawn
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def _tiny_servers(tiny_model: Path, server_logs: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Both shared servers, started side by side (each spends seconds importing torch)."""
    launched = [
        ServerProcess(str(tiny_model), "--kv-cache-bytes", str(16 << 20), log_dir=server_logs, wait=False),
        ServerProcess(str(tiny_model), "--kv-cache-bytes", str(16 << 20), "--api-key", API_KEY,
                      "--max-num-seqs", "1", "--max-waiting", "1", "--max-tokens-default", "40", log_dir=server_logs,
                      wait=False),
    ]
    try:
        for proc in launched:
            proc.wait_ready()
        yield launched[0], launched[1]
    finally:
        for proc in launched:
            proc.stop()


@pytest.fixture(scope="session")
def server(_tiny_servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    """The shared open server: no API key, a roomy queue."""
    return _tiny_servers[0]


@pytest.fixture(scope="session")
def guarded_server(_tiny_servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    """An API key, one running request and one waiting at most (the third concurrent request is refused), and
    requests without max_tokens capped at 40 tokens."""
    return _tiny_servers[1]


def metric(server: ServerProcess, name: str, headers: dict[str, str] | None = None) -> float:
    """One sample of /metrics by its full name with labels, e.g. 'nextoken_kv_blocks_used'; 0 when absent."""
    text = httpx.get(server.url + "/metrics", headers=headers, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def wait_idle(server: ServerProcess, timeout: float = 10.0, headers: dict[str, str] | None = None) -> None:
    """Until nothing runs or waits and no KV block is in use (the state after every test)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = [metric(server, m, headers) for m in ("nextoken_requests_running", "nextoken_requests_waiting",
                                                       "nextoken_kv_blocks_used")]
        if not any(busy):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: running, waiting, blocks = {busy}")
        time.sleep(0.05)


CANARY = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def canary(server: ServerProcess) -> str:
    """The greedy canary's text: after a fault it must equal what it is on a server that saw none."""
    response = httpx.post(server.base_url + "/completions", json={"model": server.model, **CANARY}, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def assert_sigterm_drains(proc: ServerProcess, max_tokens: int) -> None:
    """SIGTERM during a stream: /health turns 503 at once, a new request gets 503 with Retry-After, the stream runs
    to its `max_tokens` (usage included) and the server exits 0."""
    body = {"model": proc.model, "prompt": "the cat", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", proc.base_url + "/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(proc.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the server never started draining"
            time.sleep(0.02)
        refused = httpx.post(proc.base_url + "/completions", json={"model": proc.model, "prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens  # it ran to the end
    assert proc.proc.wait(60) == 0, proc.log.read_text()[-3000:]
