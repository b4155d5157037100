"""`nextoken convert`: a Hugging Face directory written as a GGUF file. In f32, tensor for tensor the file llama.cpp's
conventions give (tests/hf_reference.py writes them independently), read back by the `gguf` package's own reader,
and through nextoken the very log-probabilities of the directory; in f16, q8_0 and q4_0, the types llama.cpp's
`--outtype` gives, close to the directory's results by each type's precision."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from nextoken import LLM, SamplingParams
from nextoken.errors import NextokenError
from nextoken.loader.convert import convert
from tests.hf_reference import VOCAB, build, save_directory, write_gguf
from tests.unit.test_hf_dir import tiny_tokenizer

NAMES = ["llama", "gpt2", "qwen2moe", "phi3"]  # q/k permutation, Conv1D transposes, stacked experts, fused tensors
IDS = list(range(5, VOCAB, 7))


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (its Hugging Face directory, the GGUF file tests/hf_reference.py writes for it)."""
    out = {}
    for i, name in enumerate(NAMES):
        model = build(name, seed=20 + i)
        root = tmp_path_factory.mktemp(name)
        save_directory(model, root / "hf")
        tiny_tokenizer(root / "hf")
        out[name] = (root / "hf", write_gguf(model, name, root / "reference.gguf"))
    return out


def scores(path: Path) -> list[float]:
    llm = LLM(str(path), weights="fp32", kv_dtype="fp32", kv_cache_bytes=4 << 20)
    out = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [e[0] for e in out.prompt_token_logprobs[1:]]


@pytest.mark.parametrize("name", NAMES)
def test_f32_is_llama_cpps_file_and_scores_the_same(directories: dict, name: str, tmp_path: Path) -> None:
    directory, reference = directories[name]
    result = convert(directory, tmp_path / "out.gguf", "f32")
    mine, theirs = gguf.GGUFReader(result.path), gguf.GGUFReader(reference)
    assert mine.fields["general.architecture"].contents() == theirs.fields["general.architecture"].contents()
    want = {t.name: t for t in theirs.tensors}
    got = {t.name: t for t in mine.tensors}
    assert set(got) == set(want)
    for tensor_name, t in got.items():
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(want[tensor_name].data), err_msg=tensor_name)
    assert scores(result.path) == scores(directory)


@pytest.mark.parametrize(("outtype", "matrix_type", "bar"), [
    ("f16", gguf.GGMLQuantizationType.F16, 2e-2), ("bf16", gguf.GGMLQuantizationType.BF16, 0.2),
    ("q8_0", gguf.GGMLQuantizationType.Q8_0, 0.5)])
def test_types_as_llama_cpps_outtype(directories: dict, outtype: str, matrix_type, bar: float,  # noqa: ANN001
                                     tmp_path: Path) -> None:
    directory, _ = directories["llama"]
    result = convert(directory, tmp_path / f"{outtype}.gguf", outtype)
    reader = gguf.GGUFReader(result.path)
    for t in reader.tensors:
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else matrix_type), t.name
    assert reader.fields["general.file_type"].contents() == {"f16": 1, "bf16": 32, "q8_0": 7}[outtype]
    worst = max(abs(a - b) for a, b in zip(scores(result.path), scores(directory)))
    assert 0 < worst < bar


def test_the_command_and_its_errors(directories: dict, tmp_path: Path) -> None:
    directory, _ = directories["qwen2moe"]
    out = subprocess.run([sys.executable, "-m", "nextoken", "convert", str(directory), str(tmp_path / "m.gguf"),
                          "--type", "q4_0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "wrote" in out.stdout and "Q4_0" in out.stdout, out.stderr
    assert LLM(str(tmp_path / "m.gguf"), weights="fp32", kv_cache_bytes=4 << 20).model_config.num_experts == 4
    bad = subprocess.run([sys.executable, "-m", "nextoken", "convert", str(tmp_path), str(tmp_path / "x.gguf")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "config.json" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(NextokenError, match="unknown type"):
        convert(directory, tmp_path / "y.gguf", "q3_k")
