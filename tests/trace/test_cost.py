"""cost.py against references: the parameter counts of the loaded modules and of the GGUF files, the KV pool's own
byte accounting, the FLOPs formula written out longhand, and the machine-peaks cache file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.loader.gguf import read_gguf
from nextoken.loader.registry import resolve_model
from nextoken.models.config import ModelConfig
from nextoken.trace import cost
from nextoken.trace.cost import ModelCost, machine_peaks
from nextoken.trace.run import run_request
from nextoken.trace.summary import summarize
from nextoken.trace.tracer import RecordingTracer


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_counts_match_the_loaded_model(arch: str, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(f"{arch}_llm")
    model = llm.engine.runner.model
    c = ModelCost.from_config(llm.model_config)
    projections = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert c.block_params == sum(m.weight.numel() for m in projections)
    assert c.head_params == model.embed_tokens.weight.numel()  # tied: the head is the embedding table
    assert c.kv_bytes_per_token == llm.engine.runner.kv_shape.bytes_per_token == llm.model_config.kv_bytes_per_token
    assert c.weight_bytes == sum(m.weight.nbytes for m in projections) + model.embed_tokens.weight.nbytes


@pytest.mark.parametrize(("name", "norms_per_layer"), [("smollm2-135m-instruct", lambda h, d: 2 * h),
                                                       ("gemma-3-270m", lambda h, d: 4 * h + 2 * d)])
def test_matmul_params_are_the_file_parameters_less_the_norms(name: str, norms_per_layer: object) -> None:
    cfg = ModelConfig.from_gguf(read_gguf(resolve_model(name)))
    c = ModelCost.from_config(cfg)
    assert callable(norms_per_layer)
    norms = cfg.num_layers * norms_per_layer(cfg.hidden_size, cfg.head_dim) + cfg.hidden_size  # + the final norm
    assert cfg.num_parameters - c.matmul_params == norms  # tied embeddings: counted once, as the head


def test_flops_follow_the_documented_formula(gemma_llm: LLM) -> None:
    cfg = gemma_llm.model_config  # 6 layers, layers 0-4 with a window of 8, layer 5 global
    c = ModelCost.from_config(cfg)
    per_key = 4 * cfg.num_heads * cfg.head_dim
    # One decode token at position 19: five local layers see 8 keys, the global one 20.
    assert c.forward_flops(19, 1) == 2 * c.block_params + 2 * c.head_params + per_key * (5 * 8 + 20)
    # A 3-token prefill with one logits row: positions 0..2 see 1, 2, 3 keys in every layer (inside the window).
    assert c.forward_flops(0, 3, 1) == 3 * 2 * c.block_params + 2 * c.head_params + per_key * 6 * (1 + 2 + 3)
    assert c.forward_bytes(19, 1) == c.weight_bytes + c.kv_bytes_per_token * (1 + 20)


def test_machine_peaks_are_measured_once_then_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "MIN_MEASURE_S", 0.01)  # a smaller, quicker measurement: this tests the caching
    monkeypatch.setattr(cost, "GEMM_SIZE", {"cpu": 128})
    monkeypatch.setattr(cost, "COPY_BYTES", 1 << 20)
    calls: list[int] = []
    measure = cost.measure_peaks
    monkeypatch.setattr(cost, "measure_peaks", lambda d, t: calls.append(1) or measure(d, t))
    path = tmp_path / "peaks.json"
    cpu = torch.device("cpu")
    first = machine_peaks(cpu, torch.float32, path)
    second = machine_peaks(cpu, torch.float32, path)
    assert calls == [1] and not first.cached and second.cached
    assert (second.gemm_gflops, second.copy_gbps) == (first.gemm_gflops, first.copy_gbps) and first.gemm_gflops > 0
    assert list(json.loads(path.read_text())) == [first.key]
    assert machine_peaks(cpu, torch.bfloat16, path).gemm_by == "torch.mm"  # another dtype is another entry
    assert len(calls) == 2 and len(json.loads(path.read_text())) == 2
    path.write_text("{not json")
    assert not machine_peaks(cpu, torch.float32, path).cached and len(calls) == 3


@pytest.mark.parametrize("own_faster", [True, False])
def test_gemm_peak_is_the_faster_of_torch_and_nextoken(monkeypatch: pytest.MonkeyPatch, own_faster: bool) -> None:
    """On CPU fp32 the peak is whichever GEMM ran faster (prefill runs nextoken's: a torch-only peak was exceeded),
    and the report names it. Each timed call still runs once, so a GEMM that cannot run fails here."""
    monkeypatch.setattr(cost, "GEMM_SIZE", {"cpu": 64})
    monkeypatch.setattr(cost, "COPY_BYTES", 1 << 16)
    seconds = iter([1.0, 0.5 if own_faster else 2.0, 0.1])  # torch.mm, nextoken's GEMM, the copy
    monkeypatch.setattr(cost, "_best_seconds", lambda fn, device: (fn(), next(seconds))[1])
    peaks = cost.measure_peaks(torch.device("cpu"), torch.float32)
    assert peaks.gemm_by == ("nextoken sgemm" if own_faster else "torch.mm")
    assert peaks.gemm_gflops == pytest.approx(2 * 64**3 / (0.5 if own_faster else 1.0) / 1e9)
    assert peaks.copy_gbps == pytest.approx(2 * (1 << 16) / 0.1 / 1e9)


def test_summary_accounts_for_every_step(llama_llm: LLM) -> None:
    tracer = RecordingTracer()
    run = run_request(llama_llm, "the cat sat", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                      tracer=tracer)
    s = summarize(llama_llm, run)
    c, n = s.cost, len(run.prompt_ids)
    assert s.num_prefill_tokens == n and s.num_decode_steps == 4
    assert s.prefill_flops == c.forward_flops(0, n, 1)
    assert s.decode_flops == sum(c.forward_flops(n + i, 1, 1) for i in range(4))  # positions n .. n + 3
    # KV slots for every token that went through the model (the last one drawn never does).
    assert s.blocks_used == -(-(n + 4) // llama_llm.engine.runner.block_size)
    assert s.kv_pool_bytes == llama_llm.engine.runner.kv_pool.nbytes
    assert s.decode_gflops == pytest.approx(s.decode_flops / s.decode_forward_s / 1e9)
    assert s.baseline_s is None and s.same_tokens is None
