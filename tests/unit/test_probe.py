"""The model's probe (models/probe.py) on tiny models: told of each forward pass on the path it really takes (a decode
step as one native call, the blocks as one, or the modules), in the documented order, with the native calls' times in
its profile; a probed run computes exactly what an unprobed one does, and an unprobed one hands the native calls a
null profile."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from nextoken import LLM, SamplingParams
from nextoken.models.probe import FUSED_BLOCKS, MODULES, ForwardProbe
from nextoken.ops import native
from tests.conftest import needs_native
from tests.tiny import write_tiny_model

PROMPT_IDS = [5, 9, 13, 21, 8, 40, 7]


class Events(ForwardProbe):
    """Writes down every call, and each native step's profile as it found it."""

    def __init__(self, num_layers: int) -> None:
        self.profile = native.profile_buffer(num_layers)
        self.events: list[tuple] = []

    def begin(self, positions: torch.Tensor) -> None:
        self.events.append(("begin", positions.tolist()))

    def embedded(self, path: str) -> None:
        self.events.append(("embedded", path))

    def layer_done(self, layer: int) -> None:
        self.events.append(("layer_done", layer))

    def blocks_done(self) -> None:
        self.events.append(("blocks_done", list(self.profile)))

    def end(self, logits: torch.Tensor) -> None:
        self.events.append(("end", tuple(logits.shape)))

    def native_step(self, positions: Sequence[int], logits: torch.Tensor, greedy: bool) -> None:
        self.events.append(("native_step", list(positions), tuple(logits.shape), greedy, list(self.profile)))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_q8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q8_0 token table (the tied head): with block projections its decode steps are one native call."""
    return write_tiny_model(tmp_path_factory.mktemp("q8") / f"tiny-{request.param}-q8.gguf", request.param,
                            table=GGMLQuantizationType.Q8_0)


def _llm(path: Path, weights: str) -> LLM:
    return LLM(str(path), weights=weights, device="cpu", kv_cache_bytes=4 << 20, enable_prefix_caching=False)


@needs_native
def test_the_probe_hears_the_fused_paths_and_changes_nothing(tiny_q8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm(tiny_q8, "int4")
    model = llm.engine.runner.model
    # Where the prefill kernel runs (AVX-512), the prompt's blocks are one native call too; else the modules run it.
    assert model.fused is not None and model.fused.chunks == bool(native.library().nt_has_vnni512())
    chunks = int(model.fused.chunks)
    steps: list[int | None] = []  # each native step's profile address, as the call saw it
    decode_step = native.decode_step
    monkeypatch.setattr(native, "decode_step", lambda lib, plan, *a: steps.append(plan.profile) or
                        decode_step(lib, plan, *a))
    layers: list[object] = []  # each fused blocks call's profile
    decode_layers = native.decode_layers
    monkeypatch.setattr(native, "decode_layers", lambda *a: layers.append(a[13]) or decode_layers(*a))
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = [llm.generate([PROMPT_IDS], p, use_tqdm=False)[0] for p in (params, greedy)]
    assert steps == [None] * 6 and layers == [None] * 2 * chunks  # unprobed: a null profile, nothing timed
    probe = Events(model.config.num_layers)
    model.probe = probe
    try:
        probed = [llm.generate([PROMPT_IDS], p, use_tqdm=False)[0] for p in (params, greedy)]
    finally:
        model.probe = None
    assert [(o.token_ids, o.outputs[0].logprobs) for o in probed] == \
        [(o.token_ids, o.outputs[0].logprobs) for o in plain]
    assert steps[6:] == [ctypes.addressof(probe.profile)] * 6
    assert layers[2 * chunks:] == [probe.profile] * 2 * chunks
    cfg = model.config
    prompt = 4 if chunks else 4 + cfg.num_layers
    for sampled, run in ((True, probe.events[:prompt + 3]), (False, probe.events[prompt + 3:])):
        begin, embedded, *_, blocks_done, end = run[:prompt]
        assert begin == ("begin", list(range(len(PROMPT_IDS))))
        assert embedded == ("embedded", FUSED_BLOCKS if chunks else MODULES)
        assert end == ("end", (1, cfg.vocab_size))
        native_steps = run[prompt:]
        assert [e[:4] for e in native_steps] == [("native_step", [p], (1, cfg.vocab_size), not sampled)
                                                 for p in range(len(PROMPT_IDS), len(PROMPT_IDS) + 3)]
        for *_, profile in native_steps:
            readings = profile[:native.ProfileSlot.LAYERS]
            assert readings == sorted(readings) and readings[0] > 0  # the step's stages, in order
            times = profile[native.ProfileSlot.LAYERS:]
            assert all(t > 0 for t in times)
            assert sum(times[native.LayerTime.BLOCK::native.LayerTime.TIMES]) < readings[-1] - readings[0]
        if chunks:  # the blocks' times and their end, from the prompt's native call
            assert all(t > 0 for t in blocks_done[1][native.ProfileSlot.LAYERS:])
            assert blocks_done[1][native.ProfileSlot.BLOCKS] > 0


def test_the_probe_hears_each_block_on_the_module_path(tiny_llama: Path) -> None:
    llm = _llm(tiny_llama, "fp32")
    model = llm.engine.runner.model
    assert model.fused is None
    probe = Events(model.config.num_layers)
    model.probe = probe
    try:
        out = llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        model.probe = None
    assert len(out.token_ids) == 2
    layers = [("layer_done", i) for i in range(model.config.num_layers)]
    empty = list(native.profile_buffer(model.config.num_layers))
    for positions, run in ((list(range(len(PROMPT_IDS))), probe.events[:len(layers) + 4]),
                           ([len(PROMPT_IDS)], probe.events[len(layers) + 4:])):
        assert run == [("begin", positions), ("embedded", MODULES), *layers, ("blocks_done", empty),
                       ("end", (1, model.config.vocab_size))]
