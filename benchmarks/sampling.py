"""The sampler's draw, per row: the native call (nt_sample_rows) against the same call built from another commit
(`--baseline REF`: its sampling.c and headers alone, in a temporary directory) and against the torch route
(ops/sampling.py: NEXTOKEN_NATIVE=0's and CUDA's), on random logits of the packaged models' vocabulary sizes, for
one row and for a batch, per filter setting.

Run: .venv/bin/python -m benchmarks.sampling [--baseline main] [--rows 1 64] [--repeats 7] [--threads N]
     [--stat min]
Each figure is the median (or the fastest) of `repeats` calls, in microseconds per row, the routes taking turns in
one process; each ratio is a route's time over the native one's.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import describe_machine
from nextoken.ops import native, sampling

VOCABULARIES = {"smollm2": 49_152, "gemma3": 262_144}
SETTINGS = {"temperature 1": (1.0, 0, 1.0, 0.0), "t 0.7, top-p 0.9": (0.7, 0, 0.9, 0.0),
            "t 0.7, top-k 40": (0.7, 40, 1.0, 0.0), "t 0.8, min-p 0.05": (0.8, 0, 1.0, 0.05)}
ROOT = Path(__file__).resolve().parents[1]
UNIT = "nextoken/ops/native"




def baseline_draw(ref: str, work: Path) -> Callable[..., None]:
    """nt_sample_rows as `ref` has it: its sampling.c, internal.h, nt.h and emulate512.h built alone (the host's
    flags), called with the parameter types its nt.h declares (fp32 or fp64)."""
    for name in ("sampling.c", "internal.h", "nt.h", "emulate512.h"):
        text = subprocess.run(["git", "show", f"{ref}:{UNIT}/{name}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        (work / name).write_text(text)
    header = (work / "nt.h").read_text()
    real = ctypes.c_float if "const float *temperature" in header else ctypes.c_double
    torch.ones(2).sum()  # torch's OpenMP runtime first, as native.load does
    lib = ctypes.CDLL(str(native.build(work / "sampling.c", cache_dir=work)))
    fn = lib.nt_sample_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 6,
                   ctypes.c_int]

    def draw(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
             min_p: list[float], uniforms: list[float]) -> None:
        rows = logits.shape[0]
        arrays = ((real * rows)(*temperature), (ctypes.c_int64 * rows)(*top_k), (real * rows)(*top_p),
                  (real * rows)(*min_p), (ctypes.c_double * rows)(*uniforms), (ctypes.c_int64 * rows)())
        fn(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), *(ctypes.addressof(a) for a in arrays),
           torch.get_num_threads())

    return draw


def measure(routes: dict[str, Callable[..., object]], vocab: int, rows: int, setting: tuple[float, int, float, float],
            repeats: int, stat: Callable[[list[float]], float]) -> dict[str, float]:
    """Microseconds per row of each route (`stat` of the repeats), the routes taking turns."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    args = [[v] * rows for v in setting]
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in routes}
    for draw in routes.values():
        draw(logits, *args, torch.rand(rows, generator=gen, dtype=torch.float64).tolist())  # warm-up
    for _ in range(repeats):
        uniforms = torch.rand(rows, generator=gen, dtype=torch.float64).tolist()
        for name, draw in routes.items():
            start = time.perf_counter()
            draw(logits, *args, uniforms)
            times[name].append((time.perf_counter() - start) / rows * 1e6)
    return {name: stat(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", help="also time nt_sample_rows as this commit has it")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-torch", action="store_true", help="leave out the torch route")
    parser.add_argument("--threads", type=int, help="torch's and the kernels' threads (default: torch's)")
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="of the repeats: min where other work shares the cores")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native.library()
    if lib is None:
        raise SystemExit("the native kernels are not built")
    routes: dict[str, Callable[..., object]] = {"native": lambda *a: native.sample_rows(lib, *a)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            routes[args.baseline] = baseline_draw(args.baseline, Path(tmp))
        if not args.no_torch:
            routes["torch"] = sampling.sample_rows
        print(f"{describe_machine()}; us per row, {args.stat} of {args.repeats}")
        others = [name for name in routes if name != "native"]
        print(f"{'vocabulary':>10} {'rows':>4} {'setting':18} " + " ".join(f"{name:>10}" for name in routes)
              + "".join(f" {name + '/native':>14}" for name in others))
        for model, vocab in VOCABULARIES.items():
            for rows in args.rows:
                for setting, params in SETTINGS.items():
                    us = measure(routes, vocab, rows, params, args.repeats,
                                 statistics.median if args.stat == "median" else min)
                    print(f"{vocab:>10} {rows:>4} {setting:18} " + " ".join(f"{us[n]:10.1f}" for n in routes)
                          + "".join(f" {us[n] / us['native']:13.2f}x" for n in others) + f"   ({model})")


if __name__ == "__main__":
    main()
