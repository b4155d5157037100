"""Shared by the benchmark scripts: the anchors' figures, timing helpers and result files.

Anchors are copied from ANCHORS.md (measured 2026-11-29, 2 threads, on a machine with AVX-512 and AMX): llama.cpp and
transformers on the same GGUF files. "llama.cpp AVX2" is llama.cpp measured on a 2-core AVX2 machine (AMD EPYC, no
AVX-512/AMX, where bf16 GEMMs are emulated) on 2026-11-30: llama-bench -p 512 -n 128 -t 2 -r 3 and
llama-batched-bench -npp 128 -ntg 128 -npl 1,16,64 -t 2, built from source with GGML_NATIVE. "transformers fp32/bf16
AVX2" is transformers 5.23 on that machine the same day, measured as ANCHORS.md describes (the GGUF dequantized,
SDPA, a greedy loop with its KV cache, 2 threads; prefill and batch 1 medians of 3, batched figures one run of
B x (128 prompt + 128 new) tokens). Benchmarks print our figure beside them and the ratio; compare with the rows
measured on the machine you run on. Better still, latency.py and throughput.py take --transformers PYTHON (a Python
with transformers, gguf and accelerate) and --llama-bench PATH, and measure those baselines in the same run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from nextoken import LLM
from nextoken.errors import NextokenError
from nextoken.loader.registry import resolve_model

RESULTS = Path(__file__).parent / "results"

ANCHORS = {
    "smollm2-135m-instruct": {
        "prefill_512": {"llama.cpp": 263, "transformers fp32": 847, "transformers bf16": 2633,
                        "llama.cpp AVX2": 188.5, "transformers fp32 AVX2": 387.4, "transformers bf16 AVX2": 65.1},
        "decode_1": {"llama.cpp": 96, "transformers fp32": 27, "transformers bf16": 23, "llama.cpp AVX2": 93.1,
                     "transformers fp32 AVX2": 15.0, "transformers bf16 AVX2": 25.5},
        "decode_16": {"llama.cpp": 202, "transformers fp32": 174, "transformers bf16": 256, "llama.cpp AVX2": 149.9,
                      "transformers fp32 AVX2": 95.5, "transformers bf16 AVX2": 38.7},
        "decode_64": {"llama.cpp": 221, "transformers fp32": 333, "transformers bf16": 581, "llama.cpp AVX2": 144.5,
                      "transformers fp32 AVX2": 163.9, "transformers bf16 AVX2": 45.4},
        "load_s": {"transformers fp32": 17, "transformers bf16": 16, "transformers fp32 AVX2": 20.4,
                   "transformers bf16 AVX2": 18.0},
    },
    "gemma-3-270m": {
        "prefill_512": {"llama.cpp": 544, "transformers fp32": 823, "transformers bf16": 2115,
                        "llama.cpp AVX2": 321.4, "transformers fp32 AVX2": 177.1, "transformers bf16 AVX2": 30.8},
        "decode_1": {"llama.cpp": 41, "transformers fp32": 16, "transformers bf16": 17, "llama.cpp AVX2": 58.5,
                     "transformers fp32 AVX2": 9.6, "transformers bf16 AVX2": 16.6},
        "decode_16": {"llama.cpp": 183, "transformers fp32": 108, "transformers bf16": 190, "llama.cpp AVX2": 117.2,
                      "transformers fp32 AVX2": 53.0, "transformers bf16 AVX2": 23.6},
        "decode_64": {"llama.cpp": 222, "transformers fp32": 215, "transformers bf16": 427, "llama.cpp AVX2": 130.5,
                      "transformers fp32 AVX2": 90.1, "transformers bf16 AVX2": 25.2},
        "load_s": {"transformers fp32": 48, "transformers bf16": 43},
    },
}


def median_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def versus(value: float, anchors: dict[str, float], higher_is_better: bool = True) -> str:
    parts = []
    for name, anchor in anchors.items():
        ratio = value / anchor if higher_is_better else anchor / value
        parts.append(f"{name} {anchor:g} ({ratio:.2f}x)")
    return ", ".join(parts)


def transformers_baseline(python: str, model: str, threads: int, dtypes: tuple[str, ...] = ("fp32", "bf16"),
                          batch: int = 0, batch_steps: int = 128) -> dict[str, dict[str, float]]:
    """transformers on the same GGUF file, run by `python` (which has transformers, gguf and accelerate) through
    transformers_baseline.py: per dtype, load_s, prefill_512, decode_1 and, with `batch`, decode_<batch> (tok/s)."""
    script = Path(__file__).with_name("transformers_baseline.py")
    command = [python, str(script), str(resolve_model(model)), "--threads", str(threads), "--dtypes", *dtypes,
               "--batch", str(batch), "--batch-steps", str(batch_steps)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"transformers baseline failed: {result.stderr.strip()[-800:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def default_and_int8(model: str, **options: object) -> dict[str, LLM]:
    """The model with the default formats, and again with int8 activations where its weights take them, for the
    benchmarks' --turns."""
    llms = {"default": LLM(model, **options)}  # type: ignore[arg-type]
    try:
        llms["int8 activations"] = LLM(model, activations="int8", **options)  # type: ignore[arg-type]
    except NextokenError as e:
        print(f"{model} int8 activations: skipped ({e})")
    for llm in llms.values():
        llm.engine.runner.settle()  # the weights on huge pages before any timing
    return llms


class TransformersWorker:
    """transformers_baseline.py --serve under `python`: the file loaded once in each dtype, then measured on request,
    so that its figures can take turns with ours minute by minute (latency.py and throughput.py --turns)."""

    def __init__(self, python: str, model: str, threads: int, dtypes: tuple[str, ...] = ("bf16",)) -> None:
        script = Path(__file__).with_name("transformers_baseline.py")
        self.errors = tempfile.TemporaryFile(mode="w+")  # its warnings, read back only if it fails
        self.process = subprocess.Popen([python, str(script), str(resolve_model(model)), "--threads", str(threads),
                                         "--dtypes", *dtypes, "--serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.errors, text=True)
        self.load_s: dict[str, float] = self._answer()["load_s"]

    def _answer(self) -> dict:
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line:
            self.errors.seek(0)
            raise RuntimeError(f"transformers worker failed: {self.errors.read().strip()[-800:]}")
        return json.loads(line)

    def tok_s(self, dtype: str, **request: int) -> float:
        """tok/s of one request: prefill=N (one pass over N tokens), decode=N (N greedy steps of one sequence, after
        a prompt of depth=D tokens, default 1) or batch=B, steps=N (N greedy steps of B sequences after a 128-token
        prompt each)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"dtype": dtype, **request}) + "\n")
        self.process.stdin.flush()
        return float(self._answer()["tok_s"])

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=60)
        self.errors.close()

    def __enter__(self) -> TransformersWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The CPU features that decide which kernels run (ours, llama.cpp's, oneDNN's under torch): every figure is named
# with the ones its machine has.
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
            "amx_bf16")


def machine() -> dict[str, object]:
    """The machine a figure ran on: the CPU's model, its logical CPUs and kernel-deciding features (/proc/cpuinfo),
    torch's threads, and the native kernels' route (ops/native: AVX-512 VNNI, with AMX or not, AVX2 or plain C)."""
    import torch

    from nextoken.ops import native

    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    lib = native.library()
    route = "none" if lib is None else "AVX-512 VNNI" if lib.nt_has_vnni512() else \
        "AVX2" if lib.nt_has_avx2() else "plain C"
    if lib is not None and lib.nt_amx(-1):
        route += " + AMX-INT8"
    import os

    return {"cpu": model, "cpus": os.cpu_count(), "features": [f for f in FEATURES if f in flags],
            "threads": torch.get_num_threads(), "kernels": route}


def describe_machine() -> str:
    """machine() in one line, for the top of a benchmark's output."""
    m = machine()
    return (f"CPU: {m['cpu']}, {m['cpus']} CPUs, {' '.join(m['features']) or 'no AVX2'}; {m['threads']} threads; "  # type: ignore[arg-type]
            f"native kernels: {m['kernels']}")


def save(name: str, payload: dict) -> Path:
    """payload as results/NAME.json, with the machine it was measured on."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path
