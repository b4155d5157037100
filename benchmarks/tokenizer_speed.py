"""Tokenizer speed: build time (cold: merges generated; cached: merges read back) and 100 KB encode/decode/stream.

Run: .venv/bin/python benchmarks/tokenizer_speed.py [model ...]   (default: smollm2-135m-instruct gemma-3-270m)
The merges cache goes to a fresh temporary directory, so "cold" really is cold; the model files are resolved first.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from nextoken.loader.gguf import read_gguf
from nextoken.loader.registry import resolve_model
from nextoken.tokenizer.detokenize import IncrementalDetokenizer
from nextoken.tokenizer.tokenizer import Tokenizer

ENGLISH = ("The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces that a language model "
           "can embed; byte-level vocabularies never meet an unknown character, while SentencePiece ones fall back "
           "to bytes when they must. Numbers like 3.14159 and 1,234,567 are split digit by digit in some of them.\n")
CHINESE = "今天天气很好，我们去公园散步吧。机器学习模型需要把文字切分成词元，然后再转换成向量。北京是中国的首都。\n"
CODE = ('def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
        '    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n'
        'print({k: fibonacci(k) for k in range(10)})\n')


def sample_text(target_bytes: int = 100_000) -> str:
    parts: list[str] = []
    size = 0
    i = 0
    while size < target_bytes:
        part = (ENGLISH, CHINESE, CODE)[i % 3]
        parts.append(part)
        size += len(part.encode())
        i += 1
    return "".join(parts)


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(models: list[str]) -> None:
    text = sample_text()
    kb = len(text.encode()) / 1000
    rows = []
    for name in models:
        path = resolve_model(name)  # before NEXTOKEN_CACHE_DIR moves: the assembled model file may live there
        metadata = read_gguf(path).metadata
        with tempfile.TemporaryDirectory() as cache:
            old = os.environ.get("NEXTOKEN_CACHE_DIR")
            os.environ["NEXTOKEN_CACHE_DIR"] = cache
            try:
                t0 = time.perf_counter()
                Tokenizer.from_gguf(metadata)
                cold = time.perf_counter() - t0
                t0 = time.perf_counter()
                tok = Tokenizer.from_gguf(metadata)
                cached = time.perf_counter() - t0
            finally:
                if old is None:
                    del os.environ["NEXTOKEN_CACHE_DIR"]
                else:
                    os.environ["NEXTOKEN_CACHE_DIR"] = old
        ids = tok.encode(text)
        encode_s = best_of(3, lambda: tok.encode(text))
        decode_s = best_of(3, lambda: tok.decode(ids))

        def stream() -> None:
            detok = IncrementalDetokenizer(tok)
            for i in ids:
                detok.add(i)
            detok.flush()

        stream_s = best_of(3, stream)
        assert tok.decode(ids, skip_special_tokens=True) == text
        rows.append((name, tok.kind, tok.vocab_size, cold, cached, len(ids), encode_s, decode_s, stream_s))

    print(f"text: {kb:.0f} KB of mixed English / Chinese / Python code\n")
    header = ("model", "kind", "vocab", "build cold", "build cached", "tokens", "encode", "decode", "stream")
    print("{:<24} {:<4} {:>7} {:>11} {:>13} {:>7} {:>9} {:>9} {:>9}".format(*header))
    for name, kind, vocab, cold, cached, n, enc, dec, stream_s in rows:
        print(f"{name:<24} {kind:<4} {vocab:>7} {cold:>10.2f}s {cached:>12.2f}s {n:>7} "
              f"{enc * 1000:>7.1f}ms {dec * 1000:>7.1f}ms {stream_s * 1000:>7.1f}ms")


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2-135m-instruct", "gemma-3-270m"])
