"""Replicas against one engine on the same cores: aggregate output tokens/s at 64 concurrent streaming requests for
one process x 2 threads, 1 Ray Serve replica x 2 threads, and 2 replicas x 1 thread, in one run.

Run: .venv/bin/python -m benchmarks.replicas [--model smollm2-135m-instruct] [--concurrency 64] [--output-len 64]
Each configuration is a fresh `nextoken serve` on 127.0.0.1 (a free port), warmed up with a few requests, then sent
`concurrency` streaming /v1/completions at once (distinct prompts of about 40 tokens, `ignore_eos`, greedy); the
figure is the output tokens received over the wall time from the first send to the last token. Each server is stopped
before the next starts. Needs the ray extra (pip install 'nextoken[ray]').
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx

from benchmarks.speculative import cpu_name

_READY = re.compile(r"serving (\S+) at (http://\S+)/v1")
CONFIGS = {"1 process x 2 threads": ["--threads", "2"],
           "1 replica x 2 threads": ["--replicas", "1", "--threads", "2"],
           "2 replicas x 1 thread": ["--replicas", "2", "--threads", "1"]}


def start(model: str, args: list[str]) -> tuple[subprocess.Popen[str], str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "nextoken", "serve", "--model", model, "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if match := _READY.search(line):
            return proc, match.group(1), match.group(2)
    raise RuntimeError(f"the server did not start (exit code {proc.wait()})")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def load(url: str, model: str, concurrency: int, output_len: int) -> tuple[int, float]:
    """(output tokens, seconds) of `concurrency` streams sent at once."""
    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": model, "prompt": f"Request {i}: write a long, detailed story about a lighthouse keeper "
                                          f"named Ada number {i} who finds a message in a bottle on the shore.",
                "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        tokens = 0
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                    tokens = usage["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(one(http, -i - 1) for i in range(4)))  # warm-up
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(http, i) for i in range(concurrency)))
        return sum(counts), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}")
    print(f"{args.model}, {args.concurrency} concurrent streams x {args.output_len} tokens")
    for name, extra in CONFIGS.items():
        proc, model, url = start(args.model, extra)
        try:
            tokens, seconds = asyncio.run(load(url, model, args.concurrency, args.output_len))
        finally:
            stop(proc)
        print(f"  {name:24s} {tokens / seconds:8.1f} tok/s  ({tokens} tokens in {seconds:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
