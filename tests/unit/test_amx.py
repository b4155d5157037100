"""The GEMM over block weights on AMX-INT8 tiles (amx.c): exact integer sums of byte products, then the VNNI route's
float operations in its order, so the two routes give the same bits. Where the CPU has AMX the host's build runs the
real tiles; elsewhere the emulated build (emulate_amx.h, beside emulate512.h) runs the same source, so the tiling and
the packing are tested on every machine."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from nextoken.ops import native
from nextoken.ops.native.build import compiler
from tests.unit.test_native import gemm_cases, gemm_out, level_error


@pytest.fixture(scope="module")
def amx(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A build with the AMX route: the host's where the CPU and the kernel give it, else the emulated one. Either way
    the route is off until asked for (the `vnni` fixture's tests share the emulated library and run the VNNI
    route)."""
    before = lib.nt_amx(-1)
    if lib.nt_amx(1):
        lib.nt_amx(before)
        return lib
    emulated = native.load(native.build(flags=native.EMULATED_AVX512_FLAGS))
    assert emulated.nt_amx(-1) == 0  # emulated: off unless asked
    return emulated


def both_routes(library: ctypes.CDLL, run):  # noqa: ANN001, ANN201 - run() -> Tensor
    """run() through the VNNI route, then through AMX; the library's setting is put back."""
    before = library.nt_amx(-1)
    try:
        assert library.nt_amx(0) == 0
        vnni = run()
        assert library.nt_amx(1) == 1
        return vnni, run()
    finally:
        library.nt_amx(before)


@pytest.mark.parametrize("int8_activations", [False, True])
def test_amx_gemm_has_the_vnni_routes_bits(amx: ctypes.CDLL, int8_activations: bool) -> None:
    """Every block format (Q4 with fp16 and fp32 offsets, Q8, Q8 in halves: tiles of 8 and 4 rows of weight codes),
    two levels of activation codes, each as two planes of bytes (code rows past whole tiles of 16) or int8 codes
    with their outlier columns chosen over the rows, column counts past whole pairs of 16-column panels, rows of x
    with a stride, 1-3 threads: the same bits as the VNNI route, and within fp32 rounding of a float64 product for
    the exact codes."""
    cases = 0
    for part, w, x in gemm_cases(11, outliers=True):
        if int8_activations and x.shape[0] <= 16:  # fewer rows take the few-row kernel, not a GEMM
            continue
        for threads in (1, 2, 3):
            vnni, tiles = both_routes(amx, lambda: gemm_out(amx, part, x, threads, int8_activations))
            assert torch.equal(vnni, tiles), (part.kind, tuple(w.shape), x.shape[0], threads)
            cases += 1
        if not int8_activations:
            bound = 1e-5 * (x.abs().double() @ w.abs().t()).float() + 2 * level_error(x, w).float() + 1e-6
            assert ((tiles - (x.double() @ w.t()).float()).abs() <= bound).all()
    assert cases >= 40


def test_amx_gemm_with_fixed_outlier_columns(amx: ctypes.CDLL) -> None:
    """int8 activation codes with their outlier columns fixed (as calibration fixes them): the same bits on both routes,
    whatever the rows, and a row's numbers are its own in any batch (the 17th to 40th rows alone and in the batch)."""
    for part, _, x in gemm_cases(12, outliers=True):
        if x.shape[0] <= 16:
            continue
        k, n = x.shape[1], part.qs.shape[0]
        outliers = torch.arange(1, k, max(1, k // 5), dtype=torch.int32)[:native.OUTLIER_MAX]

        def run(rows: torch.Tensor) -> torch.Tensor:
            out = torch.full((rows.shape[0], n), float("nan"))
            native.block_matmul(amx, part.kind, rows, part.qs, part.d, part.m, out, gemm=True, int8_activations=True,
                                outliers=outliers)
            return out

        vnni, tiles = both_routes(amx, lambda: run(x))
        assert torch.equal(vnni, tiles), (part.kind, tuple(part.qs.shape), x.shape[0])
        _, alone = both_routes(amx, lambda: run(x[16:]))
        assert torch.equal(alone, tiles[16:])


def test_few_rows_on_amx_have_the_same_bits(amx: ctypes.CDLL) -> None:
    """Products of a few rows (nt_block_matmul's from two rows, nt_block_gemm8's with fixed outlier columns up to 16)
    take the AMX GEMM from 8 rows instead of the few-row kernel: every row count from 2 to 16 gives the same bits
    with the route on and off, for both kinds of activation codes."""
    checked = 0
    for part, _, x in gemm_cases(13, outliers=True):
        if x.shape[0] < 16:
            continue
        k, n = x.shape[1], part.qs.shape[0]
        outliers = torch.arange(2, k, max(1, k // 3), dtype=torch.int32)[:native.OUTLIER_MAX]
        for rows in range(2, 17):
            for int8 in (False, True):
                def run() -> torch.Tensor:
                    out = torch.full((rows, n), float("nan"))
                    native.block_matmul(amx, part.kind, x[:rows], part.qs, part.d, part.m, out, gemm=int8,
                                        int8_activations=int8, outliers=outliers if int8 else None)
                    return out

                few, tiles = both_routes(amx, run)
                assert torch.equal(few, tiles), (part.kind, tuple(part.qs.shape), rows, int8)
                checked += 1
    assert checked >= 200


def test_the_amx_route_builds_for_sapphire_rapids(tmp_path: Path) -> None:
    """The route with the real instructions (the intrinsics, not the emulation) compiles without a warning for a CPU
    that has AMX, whatever the host: the units a Sapphire Rapids machine builds at first use, with its flags."""
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-shared")] + ["-march=sapphirerapids", "-c"]
    assert "-Werror" in flags
    here = Path(native.__file__).parent
    for unit in ("amx.c", "gemm.c"):
        done = subprocess.run([compiler(), *flags, str(here / unit), "-o", str(tmp_path / "unit.o")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert b"nt_amx" in (tmp_path / "unit.o").read_bytes() or unit != "amx.c"


def test_nextoken_amx_1_switches_the_tiles_on(amx: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """native.library() decides the route once, as it loads the kernels: off (the VNNI route, which measured the
    faster where the tiles exist), on with NEXTOKEN_AMX=1 where the build has the route and the kernel grants the
    tiles."""
    before = amx.nt_amx(-1)
    monkeypatch.setattr(native, "build", lambda: Path("built.so"))
    monkeypatch.setattr(native, "load", lambda path: amx)
    try:
        for setting, expected in (("1", 1), (None, 0), ("0", 0), ("1", 1)):
            monkeypatch.setattr(native, "_lib", None)
            monkeypatch.setattr(native, "_tried", False)
            if setting is None:
                monkeypatch.delenv("NEXTOKEN_AMX", raising=False)
            else:
                monkeypatch.setenv("NEXTOKEN_AMX", setting)
            assert native.library() is amx
            assert amx.nt_amx(-1) == expected, setting
    finally:
        amx.nt_amx(before)
