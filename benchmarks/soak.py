"""Soak and churn against a real server: `--users` concurrent clients for `--minutes`, a third of the requests
cancelled at random moments (before the first token: queued or in prefill; mid-stream; while waiting for a whole
answer),
with mixed n, stop strings, logprobs, chat and completions, short and long prompts, streamed or not.

The server's RSS and open file descriptors are sampled from /proc while it runs. At the end it checks: nothing
running or waiting and every KV block free; RSS after warm-up and open descriptors once idle flat within the
stated tolerances; a greedy canary (also sent every `--canary-every` seconds under load) equal to its answer on the
idle server; no error of any kind. Prints a summary and exits 1 when a check fails.

    python benchmarks/soak.py --minutes 30 --users 64 --model tiny
    python benchmarks/soak.py --minutes 10 --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server.conftest import CANARY, ServerProcess, metric  # noqa: E402
from tests.tiny import write_tiny_model  # noqa: E402

STOPS = ["\n", "the", ".", "ab", "e e", "zz"]
WORDS = "the cat sat on a mat while seven seas rolled far below under an old grey sky and nobody spoke".split()


@dataclass
class Sample:
    at_s: float
    rss_mib: float
    num_fds: int


@dataclass
class Summary:
    duration_s: float = 0.0
    num_requests: int = 0
    num_completed: int = 0
    cancelled: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    error_details: list[str] = field(default_factory=list)  # the first few, with their request
    num_canaries: int = 0
    tokens: int = 0
    finished: dict[str, float] = field(default_factory=dict)
    num_preemptions: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    fds_idle_start: int = 0
    fds_idle_end: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        rss = [s.rss_mib for s in self.samples]
        fds = [s.num_fds for s in self.samples]
        lines = [
            f"duration          {self.duration_s / 60:.1f} min",
            f"requests          {self.num_requests} sent, {self.num_completed} completed, "
            f"{sum(self.cancelled.values())} cancelled ({dict(self.cancelled)})",
            f"canaries          {self.num_canaries} under load, all equal to the idle answer: "
            f"{'canary mismatch' not in self.errors}",
            f"errors            {dict(self.errors) or 'none'}",
            *(f"  {detail}" for detail in self.error_details),
            f"tokens generated  {self.tokens}",
            f"engine requests   ended by reason {self.finished}; preemptions {self.num_preemptions:.0f}",
            f"RSS (MiB)         start {rss[0]:.1f}, after warm-up {self.rss_warm_mib:.1f}, end {self.rss_end_mib:.1f}, "
            f"max {max(rss):.1f}",
            f"open fds          idle before {self.fds_idle_start}, idle after {self.fds_idle_end}, "
            f"max under load {max(fds)}",
            "result            " + ("ok" if self.ok else "FAILED: " + "; ".join(self.failures)),
        ]
        return "\n".join(lines)


def proc_sample(pid: int, start: float) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return Sample(time.monotonic() - start, rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")))


class Load:
    """The clients' side: random requests, cancellations, counts."""

    def __init__(self, http: httpx.AsyncClient, model: str, max_model_len: int, long_ids: list[int],
                 summary: Summary, rng: random.Random) -> None:
        self.http, self.model, self.max_model_len = http, model, max_model_len
        self.long_ids, self.summary, self.rng = long_ids, summary, rng

    def body(self) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        chat = rng.random() < 0.4
        if chat:
            words = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
            body: dict[str, Any] = {"messages": [{"role": "user", "content": words}]}
            room = self.max_model_len // 2  # the chat template's tokens come on top of the words
        elif rng.random() < 0.2:  # a long prompt, as token ids: its length is known exactly
            length = rng.randint(self.max_model_len // 4, self.max_model_len * 3 // 4)
            start = rng.randint(0, len(self.long_ids) - length)
            body = {"prompt": self.long_ids[start:start + length]}
            room = self.max_model_len - length - 1
        else:
            body = {"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))}
            room = self.max_model_len // 2
        max_tokens = rng.randint(1, 48) if rng.random() < 0.8 else rng.randint(49, 200)  # mostly short answers
        body |= {"model": self.model, "max_tokens": min(max_tokens, room), "n": rng.choice((1, 1, 2, 3)),
                 "stream": rng.random() < 0.6, "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body |= {"temperature": 0.9, "top_p": 0.95}
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.3:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
        if rng.random() < 0.3:
            k = rng.randint(0, 5)
            body |= {"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k}
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return ("/v1/chat/completions" if chat else "/v1/completions"), body

    async def request(self, cancel: bool) -> None:
        path, body = self.body()
        self.summary.num_requests += 1
        start = time.monotonic()
        try:
            left = await (self._stream if body["stream"] else self._whole)(path, body, cancel)
        except httpx.HTTPError as exc:
            self.summary.errors[type(exc).__name__] += 1
            if len(self.summary.error_details) < 10:
                shown = {k: (f"{len(v)} token ids" if k == "prompt" and isinstance(v, list) else v)
                         for k, v in body.items() if k not in ("model", "messages")}
                self.summary.error_details.append(f"{type(exc).__name__} ({exc}) after "
                                                  f"{time.monotonic() - start:.2f} s: {path} {shown}")
            return
        if left is None:
            self.summary.num_completed += 1
        else:
            self.summary.cancelled[left] += 1

    async def _whole(self, path: str, body: dict[str, Any], cancel: bool) -> str | None:
        """None when the answer came; else the moment the client left."""
        post = self.http.post(path, json=body)
        if cancel:
            try:  # the client gives up after a random wait (the connection closes)
                response = await asyncio.wait_for(post, self.rng.uniform(0.0, 1.0))
            except TimeoutError:
                return "whole answer"
        else:
            response = await post
        if response.status_code != 200:
            self.summary.errors[f"http {response.status_code}"] += 1
            return None
        choices = response.json()["choices"]
        if len(choices) != body["n"] or any(c["finish_reason"] not in ("stop", "length") for c in choices):
            self.summary.errors["bad choices"] += 1
        return None

    async def _stream(self, path: str, body: dict[str, Any], cancel: bool) -> str | None:
        """None when the stream ended with [DONE]; else the moment the client left: before the first token (after
        a moment in the queue or in prefill), or after a few chunks."""
        leave_after = None if not cancel else (0 if self.rng.random() < 0.5 else self.rng.randint(1, 20))
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self.summary.errors[f"http {response.status_code}"] += 1
                return None
            if leave_after == 0:
                await asyncio.sleep(self.rng.uniform(0.0, 0.2))
                return "before first token"
            num_chunks, last = 0, ""
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line[6:]
                if last != "[DONE]":
                    event = json.loads(last)
                    if "error" in event:
                        self.summary.errors["stream error event"] += 1
                    num_chunks += 1
                if leave_after is not None and num_chunks > leave_after:
                    return "mid-stream"
            if last != "[DONE]":
                self.summary.errors["stream without [DONE]"] += 1
        return None

    async def canary(self, expected: str) -> None:
        response = await self.http.post("/v1/completions", json={"model": self.model, **CANARY})
        self.summary.num_canaries += 1
        if response.status_code != 200 or response.json()["choices"][0]["text"] != expected:
            self.summary.errors["canary mismatch"] += 1


async def drive(server: ServerProcess, minutes: float, users: int, seed: int, canary_every: float,
                sample_every: float, summary: Summary) -> str:
    """Run the load; returns the canary's idle answer."""
    rng = random.Random(seed)
    # Idle connections are dropped well before the server's 5 s keep-alive ends: one reused just as the server closes
    # it fails with a ReadError that says nothing about the server.
    limits = httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(300.0), limits=limits) as http:
        info = (await http.get("/v1/models")).json()["data"][0]
        text = " ".join(rng.choices(WORDS, k=4000))
        long_ids = (await http.post("/tokenize", json={"model": server.model, "prompt": text})).json()["tokens"]
        load = Load(http, server.model, info["max_model_len"], long_ids, summary, rng)
        alone = (await http.post("/v1/completions", json={"model": server.model, **CANARY})).json()
        expected = alone["choices"][0]["text"]
        start = time.monotonic()
        deadline = start + minutes * 60

        async def user() -> None:
            while time.monotonic() < deadline:
                await load.request(cancel=rng.random() < 1 / 3)

        async def watch() -> None:
            next_canary = time.monotonic() + canary_every
            while time.monotonic() < deadline:
                summary.samples.append(proc_sample(server.proc.pid, start))
                if time.monotonic() >= next_canary:
                    await load.canary(expected)
                    next_canary += canary_every
                await asyncio.sleep(sample_every)

        await asyncio.gather(watch(), *(user() for _ in range(users)))
        summary.duration_s = time.monotonic() - start
    return expected


def check_idle(server: ServerProcess, summary: Summary, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    names = ("nextoken_requests_running", "nextoken_requests_waiting", "nextoken_kv_blocks_used")
    while any(busy := [metric(server, name) for name in names]):
        if time.monotonic() > deadline:
            summary.failures.append(f"not idle {timeout:.0f} s after the load: running, waiting, blocks = {busy}")
            return
        time.sleep(0.1)


def run(model: Path | str, minutes: float, users: int = 64, *, seed: int = 0, threads: int | None = None,
        kv_cache_bytes: int = 2 << 20, max_num_seqs: int = 16, rss_tolerance_mib: float = 32.0,
        fd_tolerance: int = 4, warmup_share: float = 0.25, canary_every: float = 15.0, sample_every: float = 2.0,
        log_dir: Path | None = None) -> Summary:
    """The whole soak against a server started here (stopped at the end); see the module docstring."""
    summary = Summary()
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--kv-cache-bytes", str(kv_cache_bytes), "--max-num-seqs", str(max_num_seqs)]
        args += ["--threads", str(threads)] if threads else []
        server = ServerProcess(str(model), *args, log_dir=log_dir or Path(tmp))
        try:
            idle_fds = proc_sample(server.proc.pid, 0).num_fds
            summary.samples.append(proc_sample(server.proc.pid, 0))
            expected = asyncio.run(drive(server, minutes, users, seed, canary_every, sample_every, summary))
            check_idle(server, summary)
            summary.samples.append(proc_sample(server.proc.pid, summary.duration_s))
            # Connections the clients closed may take a moment to be closed on the server's side too.
            deadline = time.monotonic() + 10
            while (fds := proc_sample(server.proc.pid, 0).num_fds) > idle_fds + fd_tolerance \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            summary.fds_idle_start, summary.fds_idle_end = idle_fds, fds
            final = httpx.post(server.url + "/v1/completions", json={"model": server.model, **CANARY}, timeout=60)
            if final.json()["choices"][0]["text"] != expected:
                summary.failures.append("the canary after the load differs from its idle answer")
            if httpx.get(server.url + "/health", timeout=10).status_code != 200:
                summary.failures.append("/health does not answer 200")
            text = httpx.get(server.url + "/metrics", timeout=10).text
            for line in text.splitlines():
                if line.startswith("nextoken_requests_finished_total{"):
                    summary.finished[line.split('"')[1]] = float(line.split()[-1])
            summary.num_preemptions = metric(server, "nextoken_preemptions_total")
            summary.tokens = int(metric(server, "nextoken_generation_tokens_total"))
        finally:
            server.stop()
    warm = [s.rss_mib for s in summary.samples if s.at_s >= warmup_share * summary.duration_s]
    tail = warm[len(warm) * 3 // 4:] or warm
    summary.rss_warm_mib = statistics.median(warm[:max(1, len(warm) // 4)])
    summary.rss_end_mib = statistics.median(tail)
    if summary.rss_end_mib - summary.rss_warm_mib > rss_tolerance_mib:
        summary.failures.append(f"RSS grew {summary.rss_end_mib - summary.rss_warm_mib:.1f} MiB after warm-up "
                                f"(tolerance {rss_tolerance_mib:g})")
    if summary.fds_idle_end > summary.fds_idle_start + fd_tolerance:
        summary.failures.append(f"open fds {summary.fds_idle_start} -> {summary.fds_idle_end} "
                                f"(tolerance {fd_tolerance})")
    if summary.errors:
        summary.failures.append(f"errors: {dict(summary.errors)}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--model", default="tiny", help="tiny (a generated model), a registry name, or a GGUF path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="the server's kernel threads")
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="the server's KV pool (default: 2 MiB for tiny, 64 MiB otherwise: preemptions happen)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once (the rest queue)")
    parser.add_argument("--rss-tolerance-mib", type=float, default=32.0)
    parser.add_argument("--fd-tolerance", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model: Path | str = args.model
        if args.model == "tiny":
            model = write_tiny_model(Path(tmp) / "tiny-llama.gguf", "llama",
                                     overrides={"llama.context_length": ("uint32", 1024)})
        kv = args.kv_cache_bytes or ((2 << 20) if args.model == "tiny" else (64 << 20))
        summary = run(model, args.minutes, args.users, seed=args.seed, threads=args.threads, kv_cache_bytes=kv,
                      max_num_seqs=args.max_num_seqs, rss_tolerance_mib=args.rss_tolerance_mib,
                      fd_tolerance=args.fd_tolerance)
    print(summary.report())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
