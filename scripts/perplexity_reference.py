"""Writes tests/data/perplexity_reference.json: transformers' perplexity of each packaged model on
tests/data/perplexity.txt, in the windows nextoken's `perplexity` uses (nextoken/engine/scoring.py), fp32 weights
dequantized from the same GGUF file by transformers' own GGUF loader.

Run (a Python with transformers 5.24 and accelerate, which transformers needs to read GGUF):
    .venv/bin/pip install accelerate==1.16.0 && .venv/bin/python scripts/perplexity_reference.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nextoken.engine.scoring import windows
from nextoken.loader.registry import resolve_model
from nextoken.tokenizer.tokenizer import Tokenizer
from nextoken.loader.gguf import read_gguf

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "perplexity.txt"
OUT = ROOT / "tests" / "data" / "perplexity_reference.json"
SETTINGS = [(256, 128), (128, 128), (64, 16)]  # (context, stride)


def main() -> None:
    text = TEXT.read_text(encoding="utf-8")
    results = {}
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        path = resolve_model(name)
        # The ids as nextoken encodes them (tests/integration/test_tokenizer_reference.py holds them to the
        # reference tokenizers); transformers scores the same ids.
        ids = Tokenizer.from_gguf(read_gguf(path).metadata).encode(text)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        rows = {}
        for context, stride in SETTINGS:
            nll, scored = 0.0, 0
            for w in windows(len(ids), context, stride):
                with torch.no_grad():
                    logp = model(torch.tensor([ids[w.begin:w.end]])).logits[0].double().log_softmax(-1)
                for pos in range(w.first_scored, w.end):
                    nll -= float(logp[pos - w.begin - 1, ids[pos]])
                    scored += 1
            rows[f"{context}/{stride}"] = {"perplexity": math.exp(nll / scored), "scored": scored}
            print(name, context, stride, rows[f"{context}/{stride}"])
        results[name] = {"tokens": len(ids), "windows": rows}
    OUT.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
