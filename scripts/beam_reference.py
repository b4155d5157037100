"""Writes tests/data/beam_reference.json: transformers' beam search (4 beams, 16 new tokens, the end token a token like
any other, length penalty 0) and greedy search on SmolLM2 fp32 for every reference prompt, with each result's cumulative log-probability.

Run (a Python with transformers 5.24 and accelerate, which transformers needs to read GGUF):
    .venv/bin/pip install accelerate==1.16.0 && .venv/bin/python scripts/beam_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nextoken.engine.inputs import InputProcessor
from nextoken.engine.engine import load_text_side
from nextoken.loader.gguf import read_gguf
from nextoken.loader.registry import resolve_model
from nextoken.models.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "tests" / "data" / "reference" / "prompts.json"
OUT = ROOT / "tests" / "data" / "beam_reference.json"
WIDTH, NEW_TOKENS = 4, 16


def main() -> None:
    path = resolve_model("smollm2-135m-instruct")
    gguf = read_gguf(path)
    config = ModelConfig.from_gguf(gguf)
    inputs = InputProcessor(*load_text_side(gguf, config), config.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # an end token is a token like any other here (ignore_eos)
    results = {}
    for p in json.loads(PROMPTS.read_text())["prompts"]:
        # The ids as nextoken makes them (held to the reference tokenizers by the tokenizer tests).
        ids = inputs.encode(p["text"], special_tokens=True) if "text" in p else inputs.render_chat(p["messages"])[1]
        row = {}
        for name, beams in (("greedy", 1), ("beams", WIDTH)):
            out = model.generate(torch.tensor([ids]), num_beams=beams, do_sample=False, max_new_tokens=NEW_TOKENS,
                                 length_penalty=0.0, pad_token_id=0)
            tokens = out[0, len(ids):].tolist()
            with torch.no_grad():
                logp = model(torch.tensor([ids + tokens])).logits[0].double().log_softmax(-1)
            score = sum(float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(tokens))
            row[name] = {"token_ids": tokens, "cumulative_logprob": score}
        results[p["id"]] = row
        print(p["id"], row["greedy"]["cumulative_logprob"], row["beams"]["cumulative_logprob"])
    OUT.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
