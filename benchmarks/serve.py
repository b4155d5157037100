"""HTTP serving benchmark in the shape of vLLM's benchmark_serving: streaming /v1/completions requests at a fixed
concurrency or at Poisson arrivals, reporting TTFT, TPOT and inter-token latency (mean, p50, p99), request
throughput and output tokens/s.

Run: .venv/bin/python -m benchmarks.serve [--model smollm2-135m-instruct] [--num-prompts 48]
     [--concurrency 8 | --request-rate 4] [--input-len 32 256] [--output-len 16 128] [--seed 0] [--url URL]

Without --url it starts its own `nextoken serve` on 127.0.0.1 (a free port) and stops it at the end, then runs the
same requests through the engine in this process, `concurrency` in flight at a time (the baseline: the server's
TPOT over the engine's shows what serving adds per token). The dataset is
fixed by the seed: prompts are windows of a fixed English text's token ids (tokenized by the server's /tokenize),
with input and output lengths drawn uniformly from the given ranges; `ignore_eos` makes every request produce
exactly its output length. Bounded: at most --num-prompts requests, and outstanding ones are cancelled (counted as
failed) once --max-duration seconds have passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np

TEXT = (
    "The history of computing is a story of ideas that took decades to become practical. Early machines filled "
    "rooms and were programmed by rewiring panels; later ones read instructions from punched cards, then from "
    "magnetic memory. Each step made the machine more general and the programmer's work more abstract. Compilers "
    "turned formulas into machine code, operating systems shared one computer among many users, and networks "
    "joined computers into systems that no single person fully understood. Today a language model answers "
    "questions by predicting one token after another, and an inference server decides, many times a second, which "
    "requests advance, how much memory each may hold, and when a request that waits too long should be refused. "
)
_READY = re.compile(r"at (http://\S+)/v1")


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def build_dataset(pool: list[int], num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    data = []
    for _ in range(num):
        n_in = rng.randint(*input_len)
        start = rng.randrange(len(pool))
        ids = [pool[(start + i) % len(pool)] for i in range(n_in)]
        data.append((ids, rng.randint(*output_len)))
    return data


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result(ok=False, prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_len == max_tokens
        if not result.ok:
            result.error = f"{result.output_len} of {max_tokens} tokens"
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    return result


async def run_load(url: str, model: str, api_key: str | None, dataset: list[tuple[list[int], int]],
                   concurrency: int | None, request_rate: float | None, seed: int,
                   max_duration: float) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(concurrency or len(dataset)) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600), limits=limits) as http:
        await one_request(http, model, dataset[0][0][:16], 4)  # warm-up, untimed
        gate = asyncio.Semaphore(concurrency or len(dataset))
        rng = np.random.default_rng(seed)

        async def limited(prompt: list[int], max_tokens: int) -> Result:
            async with gate:
                return await one_request(http, model, prompt, max_tokens)

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in dataset:
            tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
            if request_rate is not None:
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))  # Poisson arrivals
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, max_duration - (time.perf_counter() - start)))
        for task in pending:
            task.cancel()
        duration = time.perf_counter() - start
        results = [t.result() if t in done else Result(False, len(p), error="cut by --max-duration")
                   for t, (p, _) in zip(tasks, dataset)]
        return results, duration


def report(results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    out: dict[str, float] = {"requests": len(results), "completed": len(ok), "duration_s": duration,
                             "request_throughput": len(ok) / duration,
                             "output_tokens_per_s": sum(r.output_len for r in ok) / duration,
                             "total_tokens_per_s": sum(r.output_len + r.prompt_len for r in ok) / duration}
    series = {"ttft_ms": [r.ttft * 1e3 for r in ok],
              "tpot_ms": [(r.latency - r.ttft) / (r.output_len - 1) * 1e3 for r in ok if r.output_len > 1],
              "itl_ms": [x * 1e3 for r in ok for x in r.itl]}
    for name, values in series.items():
        if values:
            out[f"mean_{name}"] = float(np.mean(values))
            out[f"p50_{name}"] = float(np.percentile(values, 50))
            out[f"p99_{name}"] = float(np.percentile(values, 99))
    return out


def in_process(model: str, kv_cache_bytes: int, dataset: list[tuple[list[int], int]], concurrency: int
               ) -> dict[str, float]:
    """The same requests through LLMEngine in this process (`concurrency` in flight, as the server was driven),
    after the server has stopped: mean and p50 TPOT, and output tokens/s."""
    from nextoken import LLM, SamplingParams

    engine = LLM(model, kv_cache_bytes=kv_cache_bytes).engine
    engine.add_request(dataset[0][0][:16], SamplingParams(temperature=0, max_tokens=4))  # warm-up, untimed
    while engine.has_unfinished():
        engine.step()
    waiting, done, live = list(dataset), [], 0
    start = time.perf_counter()
    while waiting or engine.has_unfinished():
        while waiting and live < concurrency:
            prompt, max_tokens = waiting.pop(0)
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            live += 1
        for out in engine.step():
            if out.finished and out.request is not None:
                done.append(out.request)
                live -= 1
    duration = time.perf_counter() - start
    tpot = [(r.timings.finished - r.timings.first_token) / (len(r.output_ids) - 1) * 1e3
            for r in done if r.timings.finished and r.timings.first_token and len(r.output_ids) > 1]
    return {"mean_tpot_ms": float(np.mean(tpot)), "p50_tpot_ms": float(np.percentile(tpot, 50)),
            "output_tokens_per_s": sum(len(r.output_ids) for r in done) / duration}


def start_server(model: str, kv_cache_bytes: int, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "nextoken", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
           "--kv-cache-bytes", str(kv_cache_bytes), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if match := _READY.search(line):
            return proc, match.group(1)
    proc.wait(30)
    raise SystemExit(f"the server did not start (exit code {proc.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--url", default=None, help="an already running server (default: start one here)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=48)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="requests in flight at once (default 8)")
    mode.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests per second")
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-duration", type=float, default=600.0, help="seconds before outstanding requests "
                                                                           "are cancelled")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="for the server started here")
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-process run of the same requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not 1 <= args.num_prompts <= 10_000:
        parser.error(f"--num-prompts {args.num_prompts}: must be in 1..10000")
    if args.request_rate is not None and args.request_rate <= 0:
        parser.error(f"--request-rate {args.request_rate}: must be > 0")
    concurrency = args.concurrency if args.concurrency is not None or args.request_rate else 8
    if args.url and urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        parser.error(f"--url {args.url}: this benchmark only loads servers on this machine (127.0.0.1)")

    proc, url = (None, args.url.rstrip("/").removesuffix("/v1")) if args.url else \
        start_server(args.model, args.kv_cache_bytes, ["--api-key", args.api_key] if args.api_key else [])
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        pool = httpx.post(url + "/tokenize", json={"model": model, "prompt": TEXT, "add_special_tokens": False},
                          headers=headers, timeout=30).json()["tokens"]
        dataset = build_dataset(pool, args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.seed)
        results, duration = asyncio.run(run_load(url, model, args.api_key, dataset, concurrency, args.request_rate,
                                                 args.seed, args.max_duration))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    figures = report(results, duration)
    baseline = None
    if proc is not None and concurrency and not args.no_baseline:
        baseline = in_process(args.model, args.kv_cache_bytes, dataset, concurrency)
    if args.json:
        print(json.dumps({"model": model, "concurrency": concurrency, "request_rate": args.request_rate,
                          **figures, **({"in_process": baseline} if baseline else {})}))
        return
    load = f"concurrency {concurrency}" if concurrency else f"request rate {args.request_rate}/s (Poisson)"
    print(f"{model}: {figures['completed']:.0f}/{figures['requests']:.0f} requests in {duration:.1f} s, {load}")
    print(f"  request throughput {figures['request_throughput']:.2f} req/s, output {figures['output_tokens_per_s']:.1f}"
          f" tok/s, total {figures['total_tokens_per_s']:.1f} tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        if f"mean_{name}" in figures:
            print(f"  {name[:-3].upper():5s} mean {figures[f'mean_{name}']:8.1f} ms   p50 {figures[f'p50_{name}']:8.1f} "
                  f"ms   p99 {figures[f'p99_{name}']:8.1f} ms")
    if baseline and "mean_tpot_ms" in figures:
        print(f"  the same requests in this process, {concurrency} in flight: TPOT mean "
              f"{baseline['mean_tpot_ms']:.1f} ms, p50 {baseline['p50_tpot_ms']:.1f} ms, output "
              f"{baseline['output_tokens_per_s']:.1f} tok/s; the server's TPOT is "
              f"{figures['mean_tpot_ms'] / baseline['mean_tpot_ms']:.2f}x the engine's")
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        print(f"  failed: {sum(not r.ok for r in results)} ({', '.join(errors)})")


if __name__ == "__main__":
    main()
