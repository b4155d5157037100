"""What `--activations int8` costs in quality, beside transformers in bf16: teacher-forced top-1 agreement with
nextoken's fp32 route (fp32 weights, head and KV cache, which the tests hold to the reference) and the mean KL from
it, over the reference prompts with their continuations and one long prompt (the reference prompts joined, past
Gemma 3's 512-token window). Rows: the default formats (two levels of activation codes), `--activations int8` (its
outlier columns fixed by the calibration pass, as every engine runs it), the same with each product choosing its
columns over its own rows (a prompt scored alone: what fixing them costs), and transformers' own forward of the same
file in bf16 (the precision most users run it in).

Run: .venv/bin/python -m benchmarks.activation_quality [--models smollm2 gemma3] [--long 800]
"""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks.common import describe_machine
from nextoken import LLM
from nextoken.check import kl_rows
from nextoken.ops import calibration, native
from tests.conftest import REAL_MODELS, load_reference


def sequences(model: str, long: int) -> list[list[int]]:
    """The reference prompts' sequences (prompt and continuation), and one of `long` tokens made of them."""
    refs = load_reference(model, "hf_top5.json")["prompts"]
    every = [t for p in refs for t in p["seq_ids"][1:]]
    return [p["seq_ids"] for p in refs] + [refs[0]["seq_ids"][:1] + (every * 20)[:long]]


def score(logprobs: list[torch.Tensor], reference: list[torch.Tensor], first_long: int) -> tuple[str, str]:
    """(short prompts, long prompt) as 'top-1 agreement, mean KL'."""
    out = []
    for part in (slice(0, first_long), slice(first_long, None)):
        agree = positions = 0
        kl = 0.0
        for lp, ref in zip(logprobs[part], reference[part]):
            agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            positions += lp.shape[0]
            kl += float(kl_rows(ref, lp).sum())
        out.append(f"{agree / positions:.2%}, KL {kl / positions:.1e}")
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(REAL_MODELS))
    parser.add_argument("--long", type=int, default=800, help="tokens of the long prompt")
    args = parser.parse_args()
    print(describe_machine())
    lib = native.library()
    if lib is None or not lib.nt_has_vnni512():
        print("note: without AVX-512 VNNI --activations int8 changes nothing (its row equals the default's)")
    for model in args.models:
        seqs = sequences(model, args.long)
        path = REAL_MODELS[model]
        fp32 = LLM(path, weights="fp32", lm_head="fp32", kv_dtype="fp32", device="cpu", enable_prefix_caching=False)
        reference = [fp32.engine.runner.score(s).double().log_softmax(-1) for s in seqs]
        file = fp32.engine.model_path
        del fp32
        gc.collect()
        rows = {}
        for name, options in (("default (int16 activations)", {}), ("--activations int8", {"activations": "int8"}),
                              ("int8, columns per product", {"activations": "int8"})):
            llm = LLM(path, device="cpu", enable_prefix_caching=False, **options)
            if name.endswith("per product"):  # each product choosing its columns over its own rows, as before
                model = llm.engine.runner.model
                for module in calibration.block_products(model).values():
                    module.outliers = None
                model.set_activations("int8")
            rows[name] = [llm.engine.runner.score(s).double().log_softmax(-1) for s in seqs]
            del llm
            gc.collect()
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.bfloat16).eval()
        with torch.inference_mode():
            rows["transformers bf16"] = [hf(torch.tensor([s])).logits[0].double().log_softmax(-1) for s in seqs]
        del hf
        gc.collect()
        print(f"\n{model}: {len(seqs) - 1} reference prompts ({sum(map(len, seqs[:-1]))} positions) | long prompt "
              f"({len(seqs[-1])} tokens); top-1 agreement with nextoken fp32, mean KL from it")
        for name, logprobs in rows.items():
            short, long = score(logprobs, reference, len(seqs) - 1)
            print(f"  {name:30s} {short:>22s} | {long}")


if __name__ == "__main__":
    main()
