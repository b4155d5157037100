"""Tensor parallelism on tiny models: the shard plan, the split projections against the whole ones, two processes on
loopback against one (teacher-forced log-probabilities, greedy, beams, scoring), the workers' end however rank 0 ends
or a worker dies, and the settings refused."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from nextoken import LLM, EngineConfig
from nextoken.errors import NextokenError
from nextoken.loader.gguf import read_gguf
from nextoken.models.config import ModelConfig
from nextoken.ops import native
from nextoken.ops.quant_linear import BlockLinear, q4_weight, q8_weight
from nextoken.parallel.group import TensorParallelError
from nextoken.parallel.shard import Shard, ShardError, plan_shards, take_columns, take_rows
from nextoken.sampling_params import SamplingParams
from tests.conftest import needs_native
from tests.tiny import write_tiny_model

KV_BYTES = 4 << 20
PROMPT = "the cat sat on the mat and then the dog sat on the log"


def _config(path: Path, **changes: int) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_gguf(read_gguf(path)), **changes)


def test_plan_splits_kv_groups_or_replicates_a_kv_head(tiny_llama: Path) -> None:
    smollm2 = _config(tiny_llama, num_heads=9, num_kv_heads=3, head_dim=64, ffn_size=1536)
    assert plan_shards(smollm2, 2, block_weights=True) == [Shard((0, 6), (0, 2), (0, 768)),
                                                           Shard((6, 9), (2, 3), (768, 1536))]
    gemma3 = _config(tiny_llama, num_heads=4, num_kv_heads=1, head_dim=256, ffn_size=2048)
    assert plan_shards(gemma3, 2, block_weights=True) == [Shard((0, 2), (0, 1), (0, 1024)),
                                                          Shard((2, 4), (0, 1), (1024, 2048))]
    assert plan_shards(gemma3, 4, block_weights=True)[3] == Shard((3, 4), (0, 1), (1536, 2048))


def test_plan_refuses_what_does_not_split(tiny_llama: Path) -> None:
    four_heads = _config(tiny_llama, num_heads=4, num_kv_heads=1, head_dim=16, ffn_size=128)
    with pytest.raises(ShardError, match="tensor_parallel=5"):
        plan_shards(four_heads, 5, block_weights=False)  # more ranks than query heads
    six_heads = _config(tiny_llama, num_heads=6, num_kv_heads=6, head_dim=16)  # 4 ranks: heads 2, 2, 1, 1
    with pytest.raises(ShardError, match="tensor_parallel=4: query head 5 starts at column 80"):
        plan_shards(six_heads, 4, block_weights=True)
    plan_shards(six_heads, 4, block_weights=False)  # fp32 projections split anywhere
    with pytest.raises(ShardError, match="tensor_parallel=8 exceeds"):
        plan_shards(_config(tiny_llama, num_heads=8, num_kv_heads=8, head_dim=32, ffn_size=224), 8,
                    block_weights=True)


@pytest.mark.parametrize("kernels", ["native", "triton"])  # triton: CUDA's kernels (interpreted without a GPU)
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_split_projections_add_up_to_the_whole(kind: str, kernels: str) -> None:
    """Rows taken are the whole product's rows; products over column shares (32-value block bounds) sum to it; the
    shares run in the kernels the whole ran in."""
    torch.manual_seed(0)
    rows, cols = 48, 128
    if kind == "q4":
        part = q4_weight(torch.randint(0, 16, (rows, cols), dtype=torch.uint8), torch.rand(rows, cols // 32) / 8,
                         -torch.rand(rows, cols // 32))
    else:
        part = q8_weight(torch.randint(-127, 128, (rows, cols)), torch.rand(rows, cols // 32) / 64)
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    whole = BlockLinear([part.to(device)], None, (rows, cols), kernels=kernels)
    x = torch.randn(3, cols).to(device)
    expected = whole(x)
    picked = torch.tensor([1, 2, 3, 40, 41])
    assert take_rows(whole, picked).kernels == take_columns(whole, 0, 64).kernels == kernels
    torch.testing.assert_close(take_rows(whole, picked)(x), expected[:, picked], rtol=1e-5, atol=1e-5)
    summed = take_columns(whole, 0, 64)(x[:, :64]) + take_columns(whole, 64, 128)(x[:, 64:])
    torch.testing.assert_close(summed, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ShardError, match=r"\[16, 128\)"):
        take_columns(whole, 16, 128)


def test_bad_settings_name_the_value(tiny_llama: Path) -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(NextokenError, match=f"tensor_parallel={bad!r}"):
            EngineConfig(tensor_parallel=bad)  # type: ignore[arg-type]
    with pytest.raises(NextokenError, match="tensor_parallel_backend='gloo'.*device='cuda'"):
        EngineConfig(tensor_parallel=2, device="cuda", tensor_parallel_backend="gloo")
    with pytest.raises(NextokenError, match="tensor_parallel_backend='nccl'.*device='cpu'"):
        EngineConfig(tensor_parallel=2, device="cpu", tensor_parallel_backend="nccl")
    with pytest.raises(NextokenError, match="tensor_parallel_backend='mpi'"):
        EngineConfig(tensor_parallel=2, tensor_parallel_backend="mpi")
    with pytest.raises(NextokenError, match="speculative='ngram' with tensor_parallel=2"):
        EngineConfig(tensor_parallel=2, speculative="ngram")
    with pytest.raises(ShardError, match="tensor_parallel=8"):  # 4 query heads, 2 KV heads: refused before any start
        LLM(str(tiny_llama), device="cpu", tensor_parallel=8, kv_cache_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "tiny-q4.gguf", "llama",
                            projections=GGMLQuantizationType.Q4_0)


def _pair(path: Path) -> tuple[LLM, LLM]:
    return (LLM(str(path), device="cpu", kv_dtype="fp32", kv_cache_bytes=KV_BYTES),
            LLM(str(path), device="cpu", kv_dtype="fp32", kv_cache_bytes=KV_BYTES, tensor_parallel=2))


def _compare(one: LLM, two: LLM) -> None:
    """Teacher-forced top-5 within 1e-4, greedy and a beam search identical, scores within 1e-4."""
    ids = one.encode(PROMPT)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    rows, base = (llm.generate([ids], scored, use_tqdm=False)[0].prompt_logprobs for llm in (one, two))
    for row, ref in zip(rows[1:], base[1:]):
        assert row[0][0] == ref[0][0]
        mine = dict(row)
        assert max(abs(mine.get(i, row[-1][1]) - lp) for i, lp in ref) < 1e-4
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [PROMPT, "the dog", "on the log the cat"]
    assert [o.token_ids for o in one.generate(prompts, greedy, use_tqdm=False)] == \
        [o.token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
    beams = SamplingParams(max_tokens=8, ignore_eos=True, beam_width=3)  # forks copy blocks on every rank
    best = [llm.generate([ids], beams, use_tqdm=False)[0].token_ids for llm in (one, two)]
    assert best[0] == best[1]
    torch.testing.assert_close(two.engine.runner.score(ids), one.engine.runner.score(ids), rtol=1e-4, atol=1e-4)


@needs_native
def test_two_ranks_match_one_on_blocks_with_kv_groups_split(tiny_q4: Path) -> None:
    one, two = _pair(tiny_q4)
    try:
        assert two.engine.runner.weights == "int4"
        assert two.engine.runner.kv_shape.num_kv_heads == 1  # of the file's 2
        _compare(one, two)
    finally:
        two.close()
    assert all(p.poll() is not None for p in two.engine.runner.tp.procs)  # type: ignore[union-attr]


def test_two_ranks_match_one_on_fp32_with_the_kv_head_replicated(tiny_gemma: Path) -> None:
    one, two = _pair(tiny_gemma)
    try:
        assert two.engine.runner.weights == "fp32"
        layer = two.engine.runner.model.layers[0].attn
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)  # of 2 query heads over 1 KV head
        _compare(one, two)
    finally:
        two.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@needs_native
def test_int8_activations_calibrate_every_rank(tiny_q4: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Under int8 activations rank 0 and its worker each fix their shares' outlier columns in one calibration pass
    (the column-parallel products see the whole input, the row-parallel ones their share; on CPUs without AVX-512
    VNNI int8 activations change nothing and no pass runs), and two ranks' greedy tokens are one rank's."""
    monkeypatch.setenv("NEXTOKEN_CACHE_DIR", str(tmp_path))
    one = LLM(str(tiny_q4), device="cpu", kv_cache_bytes=KV_BYTES, activations="int8")
    two = LLM(str(tiny_q4), device="cpu", kv_cache_bytes=KV_BYTES, activations="int8", tensor_parallel=2)
    try:
        model = two.engine.runner.model
        products = [m for m in model.modules() if isinstance(m, BlockLinear)]
        vnni = bool(native.library().nt_has_vnni512())  # without it, int8 activations change nothing
        assert products and all((m.outliers is not None) == vnni and m.activations == "int8" for m in products)
        assert model.layers[0].attn.o_proj.inner.in_features < one.engine.runner.model.layers[0].attn.o_proj.in_features
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [PROMPT, "the dog", "on the log the cat"]
        assert [o.token_ids for o in one.generate(prompts, greedy, use_tqdm=False)] == \
            [o.token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
    finally:
        two.close()


@pytest.mark.parametrize("end", ["SIGKILL", "exit"])
def test_workers_end_with_rank_0(tiny_llama: Path, end: str) -> None:
    """Rank 0 killed outright, or leaving without closing: its worker is gone within seconds."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from nextoken import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, device="cpu", kv_cache_bytes={KV_BYTES}, tensor_parallel=2)
        llm.generate(["the cat"], SamplingParams(max_tokens=4), use_tqdm=False)
        print(*(p.pid for p in llm.engine.runner.tp.procs), flush=True)
        if {end == "SIGKILL"}:
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out.stderr
    assert _gone_within(pids, 10)


def test_a_lost_worker_is_an_error_not_a_hang(tiny_llama: Path) -> None:
    two = LLM(str(tiny_llama), device="cpu", kv_cache_bytes=KV_BYTES, tensor_parallel=2)
    worker = two.engine.runner.tp.procs[0]  # type: ignore[union-attr]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    started = time.monotonic()
    params = SamplingParams(max_tokens=4)
    with pytest.raises(TensorParallelError, match="worker rank 1 exited with code -9"):
        two.generate(["the cat"], params, use_tqdm=False)
    assert time.monotonic() - started < 5
    with pytest.raises(TensorParallelError, match="stopped"):  # and it stays stopped
        two.generate(["the dog"], params, use_tqdm=False)


def test_cli_run_with_two_ranks(tiny_llama: Path) -> None:
    """`run --tensor-parallel 2` prints what one process prints; 0 ranks is a one-line error."""
    args = ["run", "--model", str(tiny_llama), "--raw", "--max-tokens", "8", "--device", "cpu", PROMPT]
    one, two = (subprocess.run([sys.executable, "-m", "nextoken", *args, *extra], capture_output=True, text=True,
                               timeout=120) for extra in ([], ["--tensor-parallel", "2"]))
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and two.stdout.strip()
    bad = subprocess.run([sys.executable, "-m", "nextoken", *args, "--tensor-parallel", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "tensor_parallel=0" in bad.stderr
    # Under torchrun: rank 0 answers, rank 1 serves its share and ends when rank 0 does.
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "nextoken", *args, "--tensor-parallel", "2"], capture_output=True, text=True,
                              timeout=120)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == one.stdout
