"""The benchmarks run against the engine as it is: each one's measurement, at its smallest, on the embedded default
model. The figures are not judged here (benchmarks/ report those), only that they come out, complete and plausible,
so an interface the engine changed cannot leave a benchmark broken until someone next runs it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nextoken
from benchmarks import common, contention, latency, profile_decode, roofline, sampling, speculative, throughput
from benchmarks.common import TransformersWorker
from nextoken import LLM
from tests.conftest import REAL_MODELS

MODEL = "smollm2"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(REAL_MODELS[MODEL], device="cpu", kv_cache_bytes=64 << 20)


def test_roofline_splits_a_decode_step() -> None:
    r = roofline.measure(REAL_MODELS[MODEL], rounds=1, steps=4)
    med, nbytes = r["median"], r["bytes"]
    assert nbytes["projections"] > nbytes["head"] > 0  # SmolLM2: 66 MB of Q4_1 blocks, a 30 MB Q8_0 head
    assert med["stream_s"] > 0 and med["hot_products_s"] > 0
    assert 0 < med["native_s"] < med["step_s"]  # the step as one native call, and the Python around it
    assert 0 < med["layers_s"] and 0 < med["head_s"] and med["layers_s"] + med["head_s"] < med["module_step_s"]


def test_latency_times_prefill_and_decode(llm: LLM) -> None:
    m = latency.measure(llm, repeats=1, prompt_len=48, decode_len=4)
    assert set(m) == {"prefill_tok_s", "decode_tok_s", "decode_empty_tok_s", "ttft_s"}
    assert all(v > 0 for v in m.values())


def test_speculative_compares_both_engines(llm: LLM) -> None:
    spec = LLM(REAL_MODELS[MODEL], device="cpu", kv_cache_bytes=64 << 20, speculative="ngram")
    name, text, params = speculative.cases(12)[0]
    r = speculative.measure(llm, spec, name, text, params, repeats=1)
    assert r["same"] and r["tokens"] > 0 and r["plain_tok_s"] > 0 and r["ngram_tok_s"] > 0
    assert 0 <= r["acceptance"] <= 1 and "CPUs" in common.describe_machine()


def test_contention_decodes_alone_and_beside_another() -> None:
    decoders = [contention.Decoder(REAL_MODELS[MODEL], nextoken.SPIN_ROUNDS, steps=4) for _ in range(2)]
    try:
        alone = contention.decode_together(decoders[:1])
        beside = contention.decode_together(decoders)
    finally:
        for d in decoders:
            d.close()
    assert len(alone) == 1 and len(beside) == 2 and all(rate > 0 for rate in alone + beside)


def test_profile_decode_tables_one_batched_step() -> None:
    text = profile_decode.run(REAL_MODELS[MODEL], "auto", 2, 2, "auto")
    assert "batch 2" in text and "ms per step" in text and "Self CPU" in text


def test_throughput_runs_a_batch_and_one_by_one(llm: LLM) -> None:
    specs = throughput.uniform_workload(llm, 4, 16, 5, random.Random(0))
    batched = throughput.run(llm, specs, "batched", 4)
    serial = throughput.run(llm, specs[:2], "one by one", 4)
    assert batched.num_output_tokens == 4 * 5 and serial.num_output_tokens == 2 * 5
    assert batched.decode_tok_s and batched.decode_tok_s > 0 and serial.decode_tok_s and serial.decode_tok_s > 0
    assert serial.scaled_wall_s == pytest.approx(serial.wall_s * 2)


def test_sampling_times_both_routes() -> None:
    from nextoken.ops import native
    from nextoken.ops import sampling as draws

    lib = native.library()
    routes = {"native": lambda *a: native.sample_rows(lib, *a), "torch": draws.sample_rows}
    m = sampling.measure(routes, 1000, 2, sampling.SETTINGS["t 0.7, top-p 0.9"], repeats=1, stat=min)
    assert set(m) == {"native", "torch"} and all(v > 0 for v in m.values())


def test_serve_times_the_server_and_the_engine_alone() -> None:
    """A server started by the benchmark, streamed to, stopped; then the same requests through the engine in
    process, whose TPOT the server's is set against."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--model", REAL_MODELS[MODEL], "--num-prompts",
                          "3", "--concurrency", "2", "--input-len", "8", "24", "--output-len", "5", "5",
                          "--kv-cache-bytes", str(64 << 20), "--json"], capture_output=True, text=True, timeout=300,
                         check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["completed"] == 3 and figures["mean_tpot_ms"] > 0
    base = figures["in_process"]
    assert base["mean_tpot_ms"] > 0 and base["output_tokens_per_s"] > 0


def stub_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for a Python with transformers: whatever script it is handed, it runs `body`."""
    script = tmp_path / "stub.py"
    script.write_text(body)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    python.chmod(0o755)
    return str(python)


# Speaks transformers_baseline.py --serve's protocol: a load line, then one answer per request.
FAKE_WORKER = """import json, sys
print(json.dumps({"load_s": {"bf16": 0.25}}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    print(json.dumps({"tok_s": 1000.0 if "prefill" in request else 10.0}), flush=True)  # decode or batch
"""


def test_latency_turns_alternate_ours_with_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--turns: each round measures transformers' prefill through the worker, then ours with the default formats
    and with int8 activations, every other round in the reverse order; the ratios are medians of per-round
    ratios."""
    order: list[str] = []
    measure, tok_s = latency.measure, common.TransformersWorker.tok_s
    monkeypatch.setattr(latency, "measure", lambda llm, *a: order.append("ours") or measure(llm, *a))
    monkeypatch.setattr(common.TransformersWorker, "tok_s",
                        lambda self, *a, **k: order.append("transformers") or tok_s(self, *a, **k))
    r = latency.head_to_head(REAL_MODELS[MODEL], 2, None, stub_python(tmp_path, FAKE_WORKER), prompt_len=48,
                             decode_len=4)
    # two warm-ups, then round 1 and round 2 reversed
    assert order == ["ours", "ours", "transformers", "ours", "ours", "ours", "ours", "transformers"]
    assert r["transformers bf16 prefill"] == 1000.0
    assert r["default prefill / transformers bf16 prefill"] == pytest.approx(r["default prefill"] / 1000)
    assert r["int8 activations prefill / default prefill"] > 0
    assert r["default decode"] > 0 and r["int8 activations decode"] > 0


def test_throughput_turns_alternate_ours_with_transformers(tmp_path: Path) -> None:
    r = throughput.turns(REAL_MODELS[MODEL], 2, stub_python(tmp_path, FAKE_WORKER), 4, 5, 64)
    assert r["transformers bf16"] == 10.0  # the stub's answer to {"batch": 4, "steps": 5}
    assert r["default"] > 0 and r["int8 activations"] > 0
    assert r["default / transformers bf16"] == pytest.approx(r["default"] / 10)


def test_transformers_worker_reports_a_failed_start(tmp_path: Path) -> None:
    broken = stub_python(tmp_path, "import sys\nsys.stderr.write('No module named transformers')\nsys.exit(1)\n")
    with pytest.raises(RuntimeError, match="transformers worker failed: No module named transformers"):
        TransformersWorker(broken, REAL_MODELS[MODEL], 1)
    with TransformersWorker(stub_python(tmp_path, FAKE_WORKER), REAL_MODELS[MODEL], 1) as worker:
        assert worker.load_s == {"bf16": 0.25}
        assert worker.tok_s("bf16", decode=8) == 10.0


def test_gemm_routes_times_torch_products_of_the_same_shapes() -> None:
    """The products gemm_routes times beside the block routes: shaped as the block product it stands beside (rows x
    k by k x n), bf16 within its rounding of the fp32 product, int8 summed exactly in int32."""
    from benchmarks import gemm_routes  # noqa: PLC0415 - the benchmark module, imported where it is tested

    xb, wb, xi, wi = gemm_routes.torch_operands_for(64, 48, 96, torch.Generator().manual_seed(0))
    products = gemm_routes.torch_products(xb, wb, xi, wi)
    bf16, int8 = products["bf16"](), products["int8"]()
    assert bf16.shape == int8.shape == (64, 48) and bf16.dtype == torch.bfloat16 and int8.dtype == torch.int32
    exact = xb.float() @ wb.float()
    assert ((bf16.float() - exact).abs() <= 1e-2 * (xb.float().abs() @ wb.float().abs()) + 1e-3).all()
    assert torch.equal(int8.long(), xi.long() @ wi.long())
