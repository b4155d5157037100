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
