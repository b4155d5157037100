"""The library's interface as Python sees it: nt.h's enums and structs mirrored for ctypes, and `layout`, the
compiler's own account of them (nt_layout), which tests/unit/test_native_layout.py holds the mirrors to."""

from __future__ import annotations

import ctypes
import enum

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Format(enum.IntEnum):
    """Block formats of quantized weights (nt_format in nt.h, where each is described)."""

    Q4 = 4
    Q4_F32 = 5
    Q8_HALVES = 6
    Q8 = 8


class KVKind(enum.IntEnum):
    """Storage of a paged KV cache (nt_kv_kind)."""

    F32 = 0
    BF16 = 1
    INT8 = 2


class Activation(enum.IntEnum):
    """Gated activations (nt_activation)."""

    SILU = 0
    GELU_TANH = 1


class ISA(enum.IntEnum):
    """The instruction sets a build targets (nt_isa_level)."""

    PORTABLE = 0
    AVX2 = 1
    AVX512_VNNI = 2


class ProfileSlot(enum.IntEnum):
    """Slots of a fused call's profile (nt_profile_slot): CLOCK_MONOTONIC readings where each stage of a native step
    ends, then `LayerTime.TIMES` seconds per layer from LAYERS on."""

    START = 0
    EMBEDDING = 1
    BLOCKS = 2
    HEAD = 3
    ARGMAX = 4
    LAYERS = 5


class LayerTime(enum.IntEnum):
    """A layer's values in a profile (nt_layer_time): seconds of attention, of the MLP and of the whole block."""

    ATTENTION = 0
    MLP = 1
    BLOCK = 2
    TIMES = 3


# Each Python enum and the prefix of its C names.
ENUMS = {Format: "NT_", KVKind: "NT_KV_", Activation: "NT_", ISA: "NT_ISA_", ProfileSlot: "NT_PROFILE_",
         LayerTime: "NT_LAYER_"}


class Part(ctypes.Structure):
    """Rows of a projection in one block format (nt_part)."""

    _fields_ = [("kind", _i64), ("n", _i64), ("k", _i64), ("qs", _ptr), ("d", _ptr), ("m", _ptr)]


MAX_PARTS = 4  # NT_MAX_PARTS
OUTLIER_MAX = 16  # NT_OUTLIER_MAX: int8 activations' outlier columns per product at most


class Matrix(ctypes.Structure):
    """A projection as stacked parts (nt_matrix)."""

    _fields_ = [("num_parts", _i64), ("n", _i64), ("parts", Part * MAX_PARTS),
                ("int8_activations", _i64), ("outliers", _ptr), ("num_outliers", _i64)]


class Layer(ctypes.Structure):
    """One decoder block's shape, weights and norms (nt_layer); null norms and biases are absent."""

    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("ffn", _i64),
                ("window", _i64), ("eps", _f32), ("scale", _f32), ("activation", _i64),
                ("rope_interleaved", _i64), ("rope_dim", _i64), ("rope_table", _i64),
                ("attn_in_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_in_norm", _ptr), ("mlp_out_norm", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("qkv_bias", _ptr),
                ("qkv", Matrix), ("o", Matrix), ("gate_up", Matrix), ("down", Matrix)]


class Cache(ctypes.Structure):
    """One layer's paged K/V (nt_cache): kind 0 fp32, 1 bf16, 2 int8 with fp16 scales."""

    _fields_ = [("k", _ptr), ("v", _ptr), ("k_scales", _ptr), ("v_scales", _ptr), ("kind", _i64),
                ("block_size", _i64)]


def profile_buffer(num_layers: int) -> ctypes.Array:
    """A zeroed profile for a model of `num_layers` blocks, as the fused calls time into it (nt_profile_slot)."""
    return (ctypes.c_double * (ProfileSlot.LAYERS + LayerTime.TIMES * num_layers))()


class Step(ctypes.Structure):
    """What a whole decode step reads besides its tokens (nt_step): the decoder's structs, buffers kept between
    steps, the token table's Q8 blocks and the LM head's int8 blocks, and a profile to time into (null: none)."""

    _fields_ = [("layers", _ptr), ("caches", _ptr), ("num_layers", _i64), ("rope_tables", _ptr), ("scratch", _ptr),
                ("x", _ptr), ("max_rows", _i64), ("gemm_rows", _i64), ("final_norm", _ptr), ("final_eps", _f32),
                ("embed_scale", _f32), ("embed_codes", _ptr), ("embed_scales", _ptr), ("vocab", _i64),
                ("head_kind", _i64), ("head_qs", _ptr), ("head_d", _ptr), ("head_rows", _i64),
                ("head_gemm_rows", _i64), ("head_int8_activations", _i64), ("head_outliers", _ptr),
                ("head_num_outliers", _i64), ("threads", _i64), ("profile", _ptr)]


class _LayoutEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def layout(lib: ctypes.CDLL) -> dict[str, int]:
    """The library's own account of its interface (nt_layout): "sizeof nt_layer", "nt_layer.qkv" (offsets), "NT_Q4"
    (enum values), as its compiler laid them out."""
    entries = ctypes.cast(lib.nt_layout(), ctypes.POINTER(_LayoutEntry))
    out: dict[str, int] = {}
    for i in range(10_000):
        if entries[i].name is None:
            return out
        out[entries[i].name.decode()] = entries[i].value
    raise RuntimeError("nt_layout: no end to the table")
