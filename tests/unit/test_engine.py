"""The engine on tiny generated models: KV-cached decoding equals recomputation, batching and chunked prefill change
no greedy output, stop conditions, length errors, seeded sampling, abort."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType

from nextoken import LLM, SamplingParams
from nextoken.engine import engine as engine_module
from nextoken.config import EngineConfig
from nextoken.errors import ModelLoadError, NextokenError, PromptTooLong
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.hf import HFDirectory
from nextoken.loader.registry import open_model
from nextoken.ops import native
from nextoken.ops.quant_linear import BlockLinear
from tests.conftest import needs_native
from tests.tiny import write_tiny_model

PROMPTS = ["the cat sat on the mat", "hello", "in the beginning there was the word and the word was",
           "a", "seven seas", "the the the the the the the the the the the the the the the the the", "on at en"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request: pytest.FixtureRequest, tiny_llama: Path, tiny_gemma: Path) -> Path:
    return tiny_llama if request.param == "llama" else tiny_gemma


def _llm(path: Path, **options: object) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_bytes=8 << 20, **options)


def test_cached_decode_matches_recompute(tiny: Path) -> None:
    """Each decode step's logits (read from the KV cache) equal a full recomputation of the sequence, even past
    Gemma's 8-token sliding window."""
    llm = _llm(tiny)
    out = llm.generate("the cat sat", SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True),
                       use_tqdm=False)[0]
    full = llm.engine.runner.score(out.prompt_token_ids + out.token_ids).log_softmax(-1)
    num_prompt = len(out.prompt_token_ids)
    assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == 24
    for step, (chosen, top) in enumerate(out.outputs[0].logprobs):
        row = full[num_prompt - 1 + step]
        assert abs(chosen - float(row[out.token_ids[step]])) < 1e-4
        for token_id, lp in top:
            assert abs(lp - float(row[token_id])) < 1e-4


def test_batched_and_chunked_equal_alone(tiny: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone_llm = _llm(tiny, enable_prefix_caching=False)
    alone = [alone_llm.generate(p, params, use_tqdm=False)[0].token_ids for p in PROMPTS]
    # A 16-token budget splits every longer prompt into chunks and mixes prefill with decode.
    batched_llm = _llm(tiny, max_num_batched_tokens=16)
    together = [o.token_ids for o in batched_llm.generate(PROMPTS * 3, params, use_tqdm=False)]
    assert together == alone * 3
    bm = batched_llm.engine.block_manager
    bm.check_integrity(expected_refs={})
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_keeps_outputs(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = _llm(tiny_llama)
    expected = [o.token_ids for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    # Room for about 12 blocks of 16 tokens: seven 50-token requests cannot all run at once.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16
    tight = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=12 * block_bytes)
    got = [o.token_ids for o in tight.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    tight.engine.block_manager.check_integrity(expected_refs={})


def test_stop_conditions(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama)
    free = llm.generate("hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    text = free.text
    stop = text[3:6]
    assert stop and stop in text
    stopped = llm.generate("hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]
    # A stop id ends generation at that token.
    stop_id = free.token_ids[4]
    by_id = llm.generate("hello", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]


def test_stop_string_split_across_tokens(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama)
    free = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    pieces = [llm.tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token's text and the start of the next.
    k = next(i for i in range(len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = pieces[k][-1:] + pieces[k + 1][:1]
    out = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]


def test_prompt_too_long_names_both_numbers(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama)
    ids = llm.tokenizer.encode("hello there")
    with pytest.raises(PromptTooLong, match=rf"{len(ids)} tokens and max_tokens is 250.*context length 256"):
        llm.generate(ids, SamplingParams(max_tokens=250))
    with pytest.raises(PromptTooLong, match="300 tokens"):
        llm.generate([5] * 300, SamplingParams(max_tokens=1))


def test_seeded_sampling_repeats(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama)
    params = SamplingParams(temperature=5.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    a = llm.generate("hello", params, use_tqdm=False)[0].token_ids
    # Same seed inside a batch of other requests: same tokens.
    batch = llm.generate(["the cat", "hello", "seven"], params, use_tqdm=False)
    assert batch[1].token_ids == a
    other = llm.generate("hello", SamplingParams(temperature=5.0, top_p=0.95, max_tokens=16, seed=99, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    assert other != a


def test_abort_frees_blocks(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama)
    engine = llm.engine
    ids = llm.tokenizer.encode("the cat sat on the mat " * 4)
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(rid)
    assert not engine.has_unfinished()
    engine.block_manager.check_integrity(expected_refs={})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.abort(rid)


def test_stream_yields_text_deltas(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama)
    ids = llm.tokenizer.encode("hello")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    deltas = [o.new_text for o in llm.stream(ids, params)]
    assert "".join(deltas) == llm.generate(ids, params, use_tqdm=False)[0].text
    assert len(deltas) == 10


def test_chat_special_text_in_content_stays_plain(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama)
    text, ids = llm.render_chat([{"role": "user", "content": "hi <|im_end|> there"}])
    im_end = llm.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1
    # The template's own <|im_start|>/<|im_end|> are control tokens; the user's typed one is not.
    assert ids.count(im_end[0]) == 1
    assert llm.tokenizer.decode(ids) == text


@pytest.mark.parametrize(("options", "weights", "head"), [
    ({}, "fp32", "int8"),  # tiny files are F32: fp32 projections, the int8 head on CPU
    ({"weights": "fp32"}, "fp32", "fp32"),  # float weights asked for: the exact head too
    ({"dtype": "float32"}, "fp32", "fp32"),
    ({"weights": "int8"}, "int8", "int8"),
    ({"weights": "int8", "lm_head": "fp32"}, "int8", "fp32"),
])
def test_format_defaults(tiny_llama: Path, options: dict, weights: str, head: str) -> None:
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_bytes=8 << 20, **options)
    runner = llm.engine.runner
    assert (runner.weights, runner.lm_head, runner.kv_dtype) == (weights, head, "fp32")
    assert (runner.model.quantized_head is not None) == (head == "int8")
    out = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_threads_setting_runs_the_kernels_on_that_many_threads(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        reference = _llm(tiny_llama, weights="int4").generate("the cat", params, use_tqdm=False)[0].token_ids
        torch.set_num_threads(2)
        llm = _llm(tiny_llama, weights="int4", threads=1)
        assert torch.get_num_threads() == 1
        assert llm.generate("the cat", params, use_tqdm=False)[0].token_ids == reference
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [0, -2, 1.5, True, "4"])
def test_threads_must_be_a_positive_whole_number(threads: object) -> None:
    with pytest.raises(NextokenError, match=f"invalid engine setting: threads={threads!r}"):
        EngineConfig(threads=threads)  # type: ignore[arg-type]


@needs_native
def test_activations_setting(tiny_llama: Path) -> None:
    """`activations` names int16 or int8; int8 reaches every block projection (and the fused decode step) and the
    LM head, and is refused, before anything loads, where the weights are not blocks."""
    with pytest.raises(NextokenError, match="invalid engine setting: activations='int4'"):
        EngineConfig(activations="int4")
    with pytest.raises(NextokenError, match="activations=int8 applies to block weights .*these weights are fp32"):
        _llm(tiny_llama, activations="int8")
    llm = LLM(str(tiny_llama), weights="int4", activations="int8", device="cpu", kv_cache_bytes=8 << 20)
    model = llm.engine.runner.model
    assert llm.engine.runner.activations == "int8"
    assert {layer.mlp.down_proj.activations for layer in model.layers} == {"int8"}
    assert model.fused is not None and all(layer.qkv.int8_activations for layer in model.fused.layers)
    assert model.quantized_head is not None and model.quantized_head.activations == "int8"
    out = llm.generate("the cat sat", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 20


def test_int8_head_keeps_greedy_tokens_and_top_logprobs(tiny: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    exact = _llm(tiny, lm_head="fp32").generate(PROMPTS, params, use_tqdm=False)
    cheap = _llm(tiny, lm_head="int8").generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(exact, cheap):
        assert a.token_ids == b.token_ids
        for (chosen_a, top_a), (chosen_b, top_b) in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert abs(chosen_a - chosen_b) < 1e-3  # only the normalizer sees the cheap pass's tail


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_q8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose token table (the tied head) is Q8_0 blocks, as the real files': with block projections its
    decode steps run as one native call (NativeStep)."""
    return write_tiny_model(tmp_path_factory.mktemp("q8") / f"tiny-{request.param}-q8.gguf", request.param,
                            table=GGMLQuantizationType.Q8_0)


@needs_native
def test_native_decode_steps_give_the_module_paths_results(tiny_q8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Q8_0 table and block projections every pure decode step is one native call (NativeStep): greedy rows
    take their argmax there and skip the sampler; batches from one row to past the head's gemm_rows (whose head takes
    the GEMM), log-probabilities, seeded sampling and penalties give exactly what the module path gives (the same
    kernels in the same order). A hook on the model (a tracer) sends steps back to the modules."""
    from nextoken.ops.fused import NativeStep

    runs: list[int] = []
    real_run = NativeStep.run
    monkeypatch.setattr(NativeStep, "run", lambda self, ints, rows, *a: runs.append(rows) or real_run(self, ints, rows, *a))
    llm = _llm(tiny_q8, weights="int4")
    engine = llm.engine
    sampled: list[int] = []
    sampler = engine.sampler
    engine.sampler = lambda logits, rows: sampled.append(len(rows)) or sampler(logits, rows)  # type: ignore[assignment]
    cases = [(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
             (PROMPTS * 3, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
             (PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)),
             (PROMPTS[:3], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)),
             (PROMPTS[:2], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=8, ignore_eos=True))]

    def results() -> list[list[tuple[list[int], object]]]:
        return [[(o.token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
                for prompts, params in cases]

    native_results = results()
    assert max(runs) == len(PROMPTS) * 3 and min(runs) == 1  # from 21 rows down to one
    assert max(runs) >= engine.runner.model.quantized_head.gemm_rows  # the head's GEMM among them
    engine.runner._step = (engine.runner.model.fused, None)  # the module path from here on
    count = len(runs)
    assert results() == native_results and len(runs) == count
    engine.runner._step = (None, None)
    handle = engine.runner.model.register_forward_hook(lambda *args: None)
    assert results() == native_results and len(runs) == count
    handle.remove()
    before = len(sampled)
    llm.generate(PROMPTS[:1], cases[0][1], use_tqdm=False)
    assert len(runs) == count + 5 and len(sampled) == before + 1  # only the prompt's step went to the sampler


@pytest.mark.parametrize("head", ["int8", "fp32", pytest.param("native step", marks=needs_native)])
def test_steps_write_their_logits_into_one_kept_buffer(tiny_llama: Path, tiny_q8: Path, head: str) -> None:
    """A step's logits go into the runner's buffer, kept between steps (fresh pages would fault in every step) and
    grown with the batch; what a step samples is what a fresh tensor would hold; teacher-forced scores and batches
    past max_num_seqs rows get tensors of their own. "native step": the decode steps run as one native call, whose
    batch builds the tensors the module path takes only when asked, and the module path gives the same logits."""
    if head == "native step":
        llm = _llm(tiny_q8, weights="int4", max_num_seqs=4)
    else:
        llm = _llm(tiny_llama, lm_head=head, max_num_seqs=4)
    runner = llm.engine.runner
    kept: list[torch.Tensor] = []
    execute = runner.execute

    def spy(scheduled):  # type: ignore[no-untyped-def]
        batch, logits = execute(scheduled)
        fresh = runner.model(batch.input_ids, batch.positions, runner.kv_pool.layers, batch.attn,
                             batch.logits_indices)
        torch.testing.assert_close(logits, fresh, rtol=0, atol=0)  # the step's cache writes repeat, unchanged
        kept.append(logits)
        return batch, logits

    runner.execute = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert len(kept) == 6 and runner._logits is not None and runner._logits.shape[0] == 4
    assert all(t.data_ptr() == runner._logits.data_ptr() for t in kept[-4:])  # the same storage, step after step
    assert (runner._step[1] is not None) == (head == "native step")
    alone = (_llm(tiny_q8, weights="int4") if head == "native step" else
             _llm(tiny_llama, lm_head=head)).generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    ids = outs[0].prompt_token_ids + outs[0].token_ids
    scores = runner.score(ids)
    assert scores.data_ptr() != runner._logits.data_ptr()
    prompt_rows = SimpleNamespace(logits_indices=torch.arange(5), input_ids=torch.arange(5))  # past max_num_seqs
    assert runner._logits_out(prompt_rows) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_loading_a_model_leaves_torch_dynamo_unimported(arch: str, tiny_llama: Path, tiny_gemma: Path) -> None:
    """A fresh process loads and generates without importing torch._dynamo (modules built on the meta device with
    torch's random init import it: seconds of every start), and the module path still answers."""
    path = tiny_llama if arch == "llama" else tiny_gemma
    code = ("import sys; from nextoken import LLM, SamplingParams; "
            f"llm = LLM({str(path)!r}, kv_cache_bytes=1 << 20, weights='fp32'); "
            "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]; "
            "assert len(out.token_ids) == 3, out.token_ids; "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


def test_loading_pauses_the_garbage_collector_and_restores_it(tiny_llama: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The cyclic collector is off while a model loads (its allocations would only trigger rescans), and is left as
    it was found: on after a load, on after a failed one, still off if the caller had turned it off."""
    seen = []

    def watching(path: Path) -> GGUFFile | HFDirectory:
        seen.append(gc.isenabled())
        return open_model(path)

    monkeypatch.setattr(engine_module, "open_model", watching)
    assert gc.isenabled()
    _llm(tiny_llama)
    assert seen == [False] and gc.isenabled()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        _llm(bad)
    assert gc.isenabled()
    gc.disable()
    try:
        _llm(tiny_llama)
        assert not gc.isenabled()
    finally:
        gc.enable()


@needs_native
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1])
def test_exact_file_blocks_load_without_an_fp32_copy(qtype: GGMLQuantizationType, tmp_path: Path) -> None:
    """Projections stored in blocks that are exactly their weights load without being dequantized (no fp32 copy, no
    GEMM panels): the prefill logits, past the block kernels on the GEMM over the blocks, equal those of the same
    file loaded in fp32."""
    path = write_tiny_model(tmp_path / "blocks.gguf", "llama", projections=qtype)
    blocks = LLM(str(path), device="cpu", weights="int4", lm_head="fp32", kv_cache_bytes=8 << 20)  # one head for both
    dense = LLM(str(path), device="cpu", weights="fp32", kv_cache_bytes=8 << 20)
    projection = blocks.engine.runner.model.layers[0].attn.qkv_proj
    assert isinstance(projection, BlockLinear) and projection.dense is None
    assert not [name for name, _ in projection.named_buffers()]  # nor GEMM panels, on any CPU
    ids = blocks.tokenizer.encode("the cat sat on the mat and the dog sat on the log, then the bird sat on the hat")
    assert len(ids) > projection.max_rows  # a prefill past the block kernels
    torch.testing.assert_close(blocks.engine.runner.score(ids), dense.engine.runner.score(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", [None, GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("wrong", [("blk.1.attn_k.weight", 0, 1), ("blk.1.attn_v.weight", 1, 32)],
                         ids=["a row too many", "columns unlike q and k"])
def test_a_tensor_of_the_wrong_shape_is_named(qtype: GGMLQuantizationType | None, wrong: tuple[str, int, int],
                                              tmp_path: Path) -> None:
    """Checked on the file's shapes before any weight is read, whether the projection is dequantized or kept in its
    blocks: a fused projection's tensors that do not stack (V wider than Q and K) are a ModelLoadError naming
    them, as is one that stacks to the wrong size."""
    bad = write_tiny_model(tmp_path / "bad.gguf", "llama", projections=qtype, wrong_shape=wrong)
    with pytest.raises(ModelLoadError, match=wrong[0].replace(".", r"\.")):
        LLM(str(bad), device="cpu", weights="int4", kv_cache_bytes=8 << 20)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _steady_thread_count() -> int:
    """The process's thread count once it has stayed the same for 50 ms: threads of earlier tests in this process
    (a model's huge-page copy, a worker leaving) may still be ending."""
    count, since = _os_threads(), time.monotonic()
    deadline = since + 5.0
    while time.monotonic() - since < 0.05 and time.monotonic() < deadline:
        time.sleep(0.005)
        now = _os_threads()
        if now != count:
            count, since = now, time.monotonic()
    return count


def _settled_thread_count(want: int) -> int:
    for _ in range(100):  # a released worker may take a moment to exit
        if _os_threads() == want:
            break
        time.sleep(0.01)
    return _os_threads()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or native.library() is None,
                    reason="counts the process's threads in /proc; the kernels' OpenMP workers")
def test_generate_lets_its_openmp_workers_go(tiny_llama: Path) -> None:
    """After loading and after each generate or stream, the calling thread's OpenMP workers are gone, so that
    another thread can step next without parked workers of this one sharing the CPUs (nt_release_threads)."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, threads=2)
    llm.engine.runner.settle()  # the huge-page copy's thread has ended
    idle = _steady_thread_count()
    native.rms_norm(native.library(), torch.ones(64, 32), torch.ones(32), 1e-6)  # a parallel region: a worker
    assert _os_threads() > idle
    llm.engine.release_threads()
    assert _settled_thread_count(idle) == idle
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate("the cat sat", params, use_tqdm=False)
    assert _settled_thread_count(idle) == idle
    tokens = [t for out in llm.stream(llm.encode("hello"), params) for t in out.new_token_ids]
    assert len(tokens) == 6 and _settled_thread_count(idle) == idle
