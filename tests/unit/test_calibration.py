"""int8 activations with outlier columns fixed at load (ops/calibration.py): the rule is the kernel's, a sequence's
numbers are the same bits alone and in any batch, and the columns are cached on disk."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from nextoken import LLM, SamplingParams
from nextoken.engine.model_loader import load_model
from nextoken.loader.gguf import read_gguf
from nextoken.models.config import ModelConfig
from nextoken.ops import calibration, native
from tests.conftest import needs_native
from tests.tiny import write_tiny_model
from tests.unit.conftest import use_library
from tests.unit.test_native import gemm_cases

PROMPTS = ["the cat sat on the mat", "hello", "in the beginning there was the word and the word was", "a",
           "seven seas", "the the the the the the the the the the the the the the the the the", "on at en"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_q8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a Q8_0 token table (the tied head), so that with block projections decode steps run fused,
    and a few loud columns in its norms' weights, so that its products have outlier columns."""
    return write_tiny_model(tmp_path_factory.mktemp("q8") / f"tiny-{request.param}-q8.gguf", request.param,
                            table=GGMLQuantizationType.Q8_0, loud_columns=(3, 17, 40))


def test_outlier_columns_follow_the_kernels_own_rule(vnni: ctypes.CDLL) -> None:
    """The columns calibration picks from a batch's column maxima are the ones the kernel picks over that batch's
    rows: the products agree bit for bit (gemm_cases' shapes, from no loud column to more than OUTLIER_MAX)."""
    counts = set()
    for part, _, x in gemm_cases(10, outliers=True):
        columns = calibration.outlier_columns(x.abs().amax(0))
        counts.add(columns.numel())
        out = torch.empty(x.shape[0], part.qs.shape[0])
        own = torch.empty_like(out)
        native.block_matmul(vnni, part.kind, x, part.qs, part.d, part.m, own, gemm=True, int8_activations=True)
        native.block_matmul(vnni, part.kind, x, part.qs, part.d, part.m, out, gemm=True, int8_activations=True,
                            outliers=columns)
        assert torch.equal(out, own), (part.kind, tuple(x.shape))
    assert native.OUTLIER_MAX in counts and len(counts) > 3


def _results(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple]:
    return [(o.token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(got: list[tuple], expected: list[tuple], exact: bool = True) -> None:
    """The same tokens and log-probabilities, bit for bit where `exact`, else within 1e-4."""
    assert len(got) == len(expected)
    for (ids, logprobs), (ids_e, logprobs_e) in zip(got, expected):
        assert ids == ids_e
        if exact:
            assert logprobs == logprobs_e
            continue
        for (chosen, top), (chosen_e, top_e) in zip(logprobs, logprobs_e):
            assert [t for t, _ in top] == [t for t, _ in top_e]
            assert max(abs(v - v_e) for (_, v), (_, v_e) in zip([(0, chosen), *top], [(0, chosen_e), *top_e])) < 1e-4


@needs_native
def test_int8_activations_give_a_sequence_its_numbers_in_any_batch(tiny_q8: Path, vnni: ctypes.CDLL,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """Under activations=int8 every block product (projections and the head) has its outlier columns fixed at load,
    so greedy tokens and their log-probabilities are the same bits alone and in a batch of 14 sequences (prefill of
    up to 200 rows, decode steps of 14: the GEMM; alone, the kernel for a few rows and the fused step). With the
    columns chosen per product instead, the batch moves them. Prompts split into chunks at other places (a 16-token
    budget, prefill beside decode rows) keep their tokens; their attention may round a last bit apart (a one-token
    chunk attends through the decode kernel). The columns are cached: a second load reads them and runs no pass;
    a damaged cache file is calibrated again and rewritten."""
    use_library(monkeypatch, vnni)  # the AVX-512 VNNI routes, emulated where the CPU has none
    monkeypatch.setenv("NEXTOKEN_CACHE_DIR", str(tmp_path))
    options = dict(weights="int4", activations="int8", device="cpu", kv_cache_bytes=8 << 20,
                   enable_prefix_caching=False)
    llm = LLM(str(tiny_q8), **options)
    model = llm.engine.runner.model
    products = calibration.block_products(model)
    assert model.fused is not None and model.quantized_head in products.values()
    assert all(m.activations == "int8" and m.outliers is not None for m in products.values())
    assert all(layer.qkv.num_outliers >= 0 and layer.down.num_outliers >= 0 for layer in model.fused.layers)
    assert sum(m.outliers.numel() for m in products.values()) > 0  # the loud columns
    cached = list((tmp_path / "calibration").glob("*.json"))
    assert len(cached) == 1
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    alone = [_results(llm, [p], params)[0] for p in PROMPTS]
    assert_same(_results(llm, PROMPTS * 2, params), alone * 2)
    chunked = LLM(str(tiny_q8), max_num_batched_tokens=16, **options)
    assert_same(_results(chunked, PROMPTS * 2, params), alone * 2, exact=False)

    for module in products.values():  # the columns chosen over each product's rows, as before calibration
        module.outliers = None
    model.set_activations("int8")
    loose = [_results(llm, [p], params)[0] for p in PROMPTS]
    with pytest.raises(AssertionError):
        assert_same(_results(llm, PROMPTS * 2, params), loose * 2)

    def no_pass(model: object) -> None:
        raise AssertionError("calibrated again despite the cache")

    with monkeypatch.context() as patch:
        patch.setattr(calibration, "recording", no_pass)
        assert_same(_results(LLM(str(tiny_q8), **options), PROMPTS, params), alone)
    cached[0].write_text(json.dumps({"layers.0.attn.qkv_proj": [5, 3]}))
    again = LLM(str(tiny_q8), **options)
    assert_same(_results(again, PROMPTS, params), alone)
    assert set(json.loads(cached[0].read_text())) == set(calibration.block_products(again.engine.runner.model))


def test_cached_columns_are_checked(tiny_q8: Path, tmp_path: Path) -> None:
    """A cache file that is not a mapping of ascending, distinct, non-negative column lists of at most OUTLIER_MAX is
    not used; columns for products the model lacks, none for one it has, or columns past a product's inputs are
    refused."""
    assert calibration.load_columns(tmp_path / "absent.json") is None
    path = tmp_path / "columns.json"
    for bad in ("[1, 2]", '{"a": [2, 1]}', '{"a": [1, 1]}', '{"a": [-1]}', '{"a": "x"}', '{"a": [1.5]}',
                json.dumps({"a": list(range(native.OUTLIER_MAX + 1))}), "not json"):
        path.write_text(bad)
        assert calibration.load_columns(path) is None, bad
    path.write_text('{"a": [1, 4]}')
    assert calibration.load_columns(path) == {"a": [1, 4]}
    gguf = read_gguf(tiny_q8)
    model = load_model(gguf, ModelConfig.from_gguf(gguf), quant="int4", quantize_head=True)
    names = list(calibration.block_products(model))
    whole = {name: [0] for name in names}
    with pytest.raises(ValueError, match="no calibrated outlier columns"):
        calibration.fix_outliers(model, {name: [0] for name in names[1:]})
    with pytest.raises(ValueError, match="not a block product"):
        calibration.fix_outliers(model, {**whole, "layers.99.mlp": [0]})
    with pytest.raises(ValueError, match="outside its"):
        calibration.fix_outliers(model, {**whole, names[0]: [10**6]})
    calibration.fix_outliers(model, whole)
    assert all(m.outliers.tolist() == [0] and m.activations == "int8"
               for m in calibration.block_products(model).values())


@needs_native
def test_a_template_that_refuses_the_calibration_chat_calibrates_on_its_text(tmp_path: Path, vnni: ctypes.CDLL,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat template that refuses the calibration conversation does not stop the load: its turns' text is the
    calibration pass's input instead."""
    use_library(monkeypatch, vnni)
    monkeypatch.setenv("NEXTOKEN_CACHE_DIR", str(tmp_path))
    strict = {"tokenizer.chat_template": ("string", "{{ raise_exception('one user turn only') }}")}
    path = write_tiny_model(tmp_path / "strict.gguf", "llama", table=GGMLQuantizationType.Q8_0,
                            loud_columns=(3, 17, 40), overrides=strict)
    llm = LLM(str(path), weights="int4", activations="int8", device="cpu", kv_cache_bytes=8 << 20)
    products = calibration.block_products(llm.engine.runner.model)
    assert products and all(m.outliers is not None for m in products.values())
    assert sum(m.outliers.numel() for m in products.values()) > 0


def test_the_cache_key_follows_the_model_files(tmp_path: Path) -> None:
    """The cache file is another one when the model file, a file of a model directory, the formats or the
    calibration tokens change."""
    file = tmp_path / "m.gguf"
    file.write_bytes(b"x" * 10)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"y" * 10)
    keys = {calibration.cache_path(file, "int4", [1, 2]), calibration.cache_path(file, "int8", [1, 2]),
            calibration.cache_path(file, "int4", [1, 3]), calibration.cache_path(folder, "int4", [1, 2])}
    file.write_bytes(b"x" * 11)
    keys.add(calibration.cache_path(file, "int4", [1, 2]))
    (folder / "model.safetensors").write_bytes(b"y" * 12)
    keys.add(calibration.cache_path(folder, "int4", [1, 2]))
    assert len(keys) == 6
    assert calibration.cache_path(file, "int4", [1, 2]) == calibration.cache_path(file, "int4", [1, 2])
