"""`serve --ray-address ADDR`: the replicas join a Ray cluster someone else started (`ray start --head` on 127.0.0.1
here), answer through the same endpoint, and on the server's exit only nextoken's application leaves the cluster: the
cluster, and whatever else runs on it, stays up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, assert_sigterm_drains

ray = pytest.importorskip("ray", reason="replicas need the ray extra: pip install 'nextoken[ray]'")
pytest.importorskip("ray.serve", reason="replicas need the ray extra: pip install 'nextoken[ray]'")

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_processes(session: int) -> list[int]:
    """The processes of the head's session (its raylet, GCS and workers all stay in it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":  # field 6 of stat, the session id
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-node Ray cluster on 127.0.0.1 started the way an operator would; every process of it killed at the end."""
    port = _free_port()
    log = tmp_path_factory.mktemp("ray-head") / "head.log"
    with open(log, "wb") as out:
        head = subprocess.Popen([RAY, "start", "--head", "--block", "--port", str(port), "--node-ip-address",
                                 "127.0.0.1", "--num-cpus", "2", "--include-dashboard", "false",
                                 "--disable-usage-stats"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while subprocess.run([RAY, "status", "--address", address], capture_output=True).returncode != 0:
            assert head.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not come up\n" + log.read_text()[-3000:]
            time.sleep(1)
        yield address
    finally:
        for pid in _cluster_processes(head.pid):  # the head and the node's processes, as `ray stop` would
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _cluster_processes(head.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _cluster_processes(head.pid):
            os.kill(pid, signal.SIGKILL)
        head.wait(10)


def _applications(address: str) -> list[str]:
    """The Serve applications running on the cluster, read by a separate driver."""
    code = ("import ray, json; from ray import serve; ray.init(address=%r, logging_level='ERROR'); "
            "print(json.dumps(sorted(serve.status().applications)))" % address)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_replicas_join_an_existing_cluster_and_leave_it_running(cluster: str, tiny_model: Path,
                                                                 server_logs: Path) -> None:
    server = ServerProcess(str(tiny_model), "--kv-cache-bytes", str(16 << 20), "--ray-address", cluster,
                           "--replicas", "2", "--threads", "1", log_dir=server_logs, wait=False)
    try:
        server.wait_ready(timeout=120)
        replicas = set()
        for i in range(6):
            r = httpx.post(server.base_url + "/completions", timeout=60,
                           json={"model": server.model, "prompt": f"count {i} " * 40, "max_tokens": 4,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            replicas.add(r.headers["x-nextoken-replica"])
        assert len(replicas) == 2
        engines = httpx.get(server.url + "/debug/engine", timeout=10).json()["replicas"]
        assert sum(1 for e in engines if e["live"]) == 2
        assert "nextoken" in _applications(cluster)
    finally:
        code = server.stop()
    assert code in (0, 130), server.log.read_text()[-3000:]
    # The server took its application away and nothing else: the cluster still answers.
    assert _applications(cluster) == []
    assert subprocess.run([RAY, "status", "--address", cluster], capture_output=True).returncode == 0


def test_an_address_with_no_cluster_is_a_one_line_error(tiny_model: Path) -> None:
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    done = subprocess.run([sys.executable, "-m", "nextoken", "serve", "--model", str(tiny_model), "--port", "0",
                           "--ray-address", address, "--replicas", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"could not join the Ray cluster at --ray-address {address!r}" in done.stderr
    assert "Traceback" not in done.stderr


def test_sigterm_drains_the_replicas_then_exits_zero(cluster: str, tiny_model: Path, server_logs: Path) -> None:
    """SIGTERM with replicas: new requests get 503, a stream in flight on a replica runs to its end, the server
    exits 0 and takes its application off the cluster."""
    server = ServerProcess(str(tiny_model), "--kv-cache-bytes", str(16 << 20), "--ray-address", cluster,
                           "--replicas", "1", "--threads", "1", "--drain-timeout", "30", log_dir=server_logs,
                           wait=False)
    try:
        server.wait_ready(timeout=120)
        assert_sigterm_drains(server, 600)
    finally:
        server.stop()
    assert _applications(cluster) == []
