"""Fixtures shared by the unit tests."""

from __future__ import annotations

import ctypes

import pytest

from nextoken.ops import native


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    built = native.library()
    if built is None:
        pytest.fail("the native kernels did not build")
    return built


@pytest.fixture(scope="module")
def vnni(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A build that runs the AVX-512 VNNI routes: the host's where the CPU has them, else the same source with
    those instructions emulated (emulate512.h: SIMDe's headers, which setup installs), so that every machine tests
    them."""
    if lib.nt_has_vnni512():
        return lib
    emulated = native.load(native.build(flags=native.EMULATED_AVX512_FLAGS))
    assert emulated.nt_has_vnni512() == 1
    return emulated


def use_library(monkeypatch: pytest.MonkeyPatch, library: ctypes.CDLL) -> None:
    """Make `library` the one every module built from here on takes (native.library())."""
    monkeypatch.setattr(native, "_lib", library)
    monkeypatch.setattr(native, "_tried", True)
