"""benchmarks/latency.py counts the kernels compiled while it is timed, to say whether a latency tail is a
compile mid-serving. flash-attn-4 4.0.0b36 keeps its compiled kernels in a `JITCache` whose dict is `.cache` and
which has no `len()`: counting it with len() raised, the error was swallowed, and the H200 runs of 2026-11-30
printed "0 kernels compiled" beside a 4 s step."""
import gc
import sys
import types

import pytest

from benchmarks import latency
from benchmarks.latency import compiled_kernels


class JITCache:  # flash_attn/cute/cache_utils.py's in-memory cache, as far as the counter reads it
    def __init__(self):
        self.cache = {}

    def __setitem__(self, key, fn):
        self.cache[key] = fn


def test_kernels_in_flash_attn_4s_jit_cache_are_counted(monkeypatch):
    def _flash_attn_fwd():
        pass
    _flash_attn_fwd.compile_cache = JITCache()
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = _flash_attn_fwd
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    flash_attn = types.ModuleType("flash_attn")
    flash_attn.cute = cute
    for module in (flash_attn, cute, interface):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    before = compiled_kernels()
    _flash_attn_fwd.compile_cache[("varlen", 128)] = object()
    _flash_attn_fwd.compile_cache[("varlen", 64)] = object()
    assert compiled_kernels() - before == 2


def test_triton_compiles_are_counted_and_named(monkeypatch):
    """Triton's own kernels (attention, sampler, KV store) can compile mid-serving too: latency.py hooks Triton's
    compiler and counts and names each variant."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)  # restored after the test
    monkeypatch.setattr(latency, "TRITON_COMPILES", [])
    latency.watch_triton_compiles()
    before = compiled_kernels()
    fn = types.SimpleNamespace(name="_pick_kernel")
    knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=fn, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    assert compiled_kernels() - before == 1 and latency.TRITON_COMPILES == ["_pick_kernel"]


def test_garbage_collections_are_timed(monkeypatch):
    """A full collection mid-serving stalls a step as a compile does: latency.py times each one."""
    monkeypatch.setattr(latency, "GC_PAUSES", [])
    callbacks = list(gc.callbacks)
    try:
        latency.watch_garbage_collections()
        gc.collect()
    finally:
        gc.callbacks[:] = callbacks
    assert len(latency.GC_PAUSES) == 1 and latency.GC_PAUSES[0][1] == 2 and latency.GC_PAUSES[0][0] > 0
