"""A run repeats bit for bit: the same teacher-forced log-probabilities and greedy tokens on one thread and on
two, in fresh processes, and while another process loads the CPU, on the default formats and on fp32 weights.

nextoken's kernels give each output one fixed order of operations (the row-major fp32 products, the block kernels
and GEMMs split over output rows, decode attention split by a context's own length), so neither the number of
threads nor their timing changes a bit there. Where torch's SDPA runs a prefill chunk with a mask (CPUs without
AVX-512, a chunk after cached context), its sums may still follow the thread count (three threads moved Gemma 3's
tokens past its window here), never the timing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nextoken.sampling_params import SamplingParams
from tests.conftest import REAL_MODELS, TEST_KV_BYTES, load_reference

ROUTES = {"default": {}, "fp32": {"weights": "fp32"}}
LONG = 600  # tokens of a prompt past Gemma's 512-token window, made of the reference prompts


def prompts(model: str) -> list[list[int]]:
    """A few reference prompts (with their greedy continuations) and one long prompt made of all of them."""
    refs = load_reference(model, "hf_top5.json")["prompts"]
    every = [t for p in refs for t in p["seq_ids"][1:]]
    return [p["seq_ids"] for p in refs[:3]] + [refs[0]["seq_ids"][:1] + (every * 8)[:LONG]]


def fingerprint(llm, ids: list[list[int]]) -> list[str]:  # noqa: ANN001
    """Per prompt, a hash of 8 greedy tokens after it with their top-5 log-probabilities, and for the short prompts
    (the long one would cost a whole vocabulary per position) of every position's top-5 too."""
    prints = []
    for prompt in ids:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                prompt_logprobs=5 if len(prompt) < LONG else None)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        rows = [[v for pair in row for v in pair] for row in (out.prompt_logprobs or [None])[1:]]
        steps = [[chosen, *(v for pair in top for v in pair)] for chosen, top in out.outputs[0].logprobs]
        digest = hashlib.sha256(np.array(rows, dtype=np.float64).tobytes())
        digest.update(np.array(steps, dtype=np.float64).tobytes() + str(out.token_ids).encode())
        prints.append(digest.hexdigest()[:16])
    return prints


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_thread_count_changes_no_bit(model: str, route: str) -> None:
    from nextoken import LLM

    ids = prompts(model)
    seen = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            llm = LLM(REAL_MODELS[model], threads=threads, kv_cache_bytes=TEST_KV_BYTES, **ROUTES[route])
            seen[threads] = fingerprint(llm, ids)
            del llm
    finally:
        torch.set_num_threads(before)  # LLM(threads=...) sets it process-wide
    assert seen[1] == seen[2]


SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
from nextoken import LLM
from tests.conftest import REAL_MODELS, TEST_KV_BYTES
from tests.models.test_determinism import ROUTES, fingerprint, prompts
result = {{}}
for model in REAL_MODELS:
    for route, options in ROUTES.items():
        llm = LLM(REAL_MODELS[model], kv_cache_bytes=TEST_KV_BYTES, **options)
        result[model + "/" + route] = fingerprint(llm, prompts(model)[:-1])  # the short ones: a process is slow
        del llm
print(json.dumps(result))
"""


def test_fresh_processes_and_a_loaded_cpu_give_the_same_bits() -> None:
    """The reference prompts' fingerprints from two fresh processes run at once (each loading the CPU the other
    runs on), and from this one."""
    root = str(Path(__file__).resolve().parents[2])
    code = SCRIPT.format(root=root)

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=root)

    group = [start(), start()]
    runs = []
    for proc in group:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert len(runs[0]) == len(REAL_MODELS) * len(ROUTES)
    # and the same as this process's own, on a CPU no one else loads
    from nextoken import LLM
    llm = LLM(REAL_MODELS["smollm2"], kv_cache_bytes=TEST_KV_BYTES)
    assert fingerprint(llm, prompts("smollm2")[:-1]) == runs[0]["smollm2/default"]


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_int8_activations_give_each_prompt_its_bits_in_a_batch(model: str) -> None:
    """Under `activations="int8"` each product's outlier columns are fixed at load (ops/calibration.py), so the
    reference prompts' greedy tokens, their top-5 log-probabilities and their prompts' top-5 are the same bits when
    the prompts run alone (decode on the kernel for a few rows) and together with the long prompt (a prefill of about 800
    rows and decode steps of 4, on the GEMM)."""
    from nextoken import LLM
    from nextoken.ops import native

    lib = native.library()
    if lib is None or not lib.nt_has_vnni512():
        pytest.skip("int8 activation codes need AVX-512 VNNI; elsewhere activations='int8' runs the default formats")
    llm = LLM(REAL_MODELS[model], activations="int8", kv_cache_bytes=TEST_KV_BYTES, enable_prefix_caching=False)
    ids = prompts(model)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=5)

    def numbers(outputs: list) -> list:  # noqa: ANN001
        return [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]

    alone = [numbers(llm.generate([p], params, use_tqdm=False))[0] for p in ids[:-1]]
    together = numbers(llm.generate(ids, params, use_tqdm=False))
    assert together[:-1] == alone


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_default_formats_give_each_prompt_its_bits_in_any_batch_of_two_or_more(model: str) -> None:
    """With AVX-512 VNNI the default formats' products of two rows and more have the int16 GEMM's bits whatever the
    batch (the few-row kernel up to 16 rows, the GEMM beyond), so two reference prompts decoded as a pair (decode steps
    of 2 rows) and among 20 (steps of 20 rows: the projections' and the head's GEMM) get the same greedy tokens and
    top-5 log-probabilities, bit for bit. (A prompt decoded alone takes the one-row kernels, whose sums run in
    another order; before the few-row kernel, the pair's rows had those too, and the test fails then.)"""
    from nextoken import LLM
    from nextoken.ops import native

    lib = native.library()
    if lib is None or not lib.nt_has_vnni512():
        pytest.skip("the few-row kernel with the GEMM's bits needs AVX-512 VNNI (elsewhere the AVX2 tiles run)")
    llm = LLM(REAL_MODELS[model], kv_cache_bytes=TEST_KV_BYTES, enable_prefix_caching=False)
    refs = [p["seq_ids"] for p in load_reference(model, "hf_top5.json")["prompts"]]
    crowd = (refs * 2)[:20]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)

    def numbers(outputs: list) -> list:  # noqa: ANN001
        return [(o.token_ids, o.outputs[0].logprobs) for o in outputs]

    pair = numbers(llm.generate(crowd[:2], params, use_tqdm=False))
    together = numbers(llm.generate(crowd, params, use_tqdm=False))
    assert together[:2] == pair
