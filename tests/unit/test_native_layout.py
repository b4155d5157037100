"""The ctypes mirrors of nt.h's structs and enums against the library's own account of them (nt_layout: sizeof,
offsetof and enum values as its compiler laid them out). A mirror that drifts from the header would hand the kernels
misplaced pointers: here it fails a test instead."""

from __future__ import annotations

import ctypes

import pytest

from nextoken.ops import native

MIRRORS = {native.Part: "nt_part", native.Matrix: "nt_matrix", native.Layer: "nt_layer", native.Cache: "nt_cache",
           native.Step: "nt_step"}


def mismatches(mirror: type[ctypes.Structure], name: str, layout: dict[str, int]) -> list[str]:
    """What differs between a ctypes mirror and the C struct `name`: size, fields missing on either side, offsets."""
    problems = []
    if layout.get(f"sizeof {name}") != ctypes.sizeof(mirror):
        problems.append(f"sizeof {name}: C {layout.get(f'sizeof {name}')}, Python {ctypes.sizeof(mirror)}")
    c_fields = {key.split(".", 1)[1]: value for key, value in layout.items() if key.startswith(f"{name}.")}
    py_fields = {field[0]: getattr(mirror, field[0]).offset for field in mirror._fields_}
    for field in c_fields.keys() ^ py_fields.keys():
        problems.append(f"{name}.{field}: only in {'C' if field in c_fields else 'Python'}")
    for field in c_fields.keys() & py_fields.keys():
        if c_fields[field] != py_fields[field]:
            problems.append(f"{name}.{field}: offset {c_fields[field]} in C, {py_fields[field]} in Python")
    return problems


@pytest.fixture(scope="module")
def layout(lib: ctypes.CDLL) -> dict[str, int]:
    return native.layout(lib)


@pytest.mark.parametrize("mirror", list(MIRRORS), ids=list(MIRRORS.values()))
def test_struct_mirror_matches_the_compiler(mirror: type[ctypes.Structure], layout: dict[str, int]) -> None:
    assert mismatches(mirror, MIRRORS[mirror], layout) == []


def test_every_struct_of_the_header_is_mirrored(layout: dict[str, int]) -> None:
    c_structs = {key.split(" ", 1)[1] for key in layout if key.startswith("sizeof ")}
    assert c_structs - {"nt_layout_entry"} == set(MIRRORS.values())


def test_enums_match_the_header(layout: dict[str, int]) -> None:
    python = {f"{prefix}{member.name}": int(member) for enum, prefix in native.ENUMS.items() for member in enum}
    c_enums = {key: value for key, value in layout.items() if key.startswith("NT_")
               and key not in ("NT_MAX_PARTS", "NT_OUTLIER_MAX")}
    assert python == c_enums
    assert layout["NT_MAX_PARTS"] == native.MAX_PARTS
    assert layout["NT_OUTLIER_MAX"] == native.OUTLIER_MAX
    assert native.library().nt_isa() in set(native.ISA)


def test_a_drifted_mirror_is_caught(layout: dict[str, int]) -> None:
    """The check itself: a mirror with two fields swapped, one missing and one extra is reported for each."""
    fields = list(native.Part._fields_)
    fields[0], fields[1] = fields[1], fields[0]

    class Swapped(ctypes.Structure):
        _fields_ = fields

    class Short(ctypes.Structure):
        _fields_ = [*native.Part._fields_[:-1], ("extra", ctypes.c_void_p)]

    assert any("offset" in p for p in mismatches(Swapped, "nt_part", layout))
    problems = mismatches(Short, "nt_part", layout)
    assert "nt_part.m: only in C" in problems and "nt_part.extra: only in Python" in problems


def test_layout_includes_the_layout_entry_itself(layout: dict[str, int]) -> None:
    assert layout["sizeof nt_layout_entry"] == ctypes.sizeof(native._LayoutEntry)
