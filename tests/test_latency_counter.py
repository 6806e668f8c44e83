"""benchmarks/latency.py counts the kernels compiled while timed, to tell a compile from a latency tail; flash-attn-4
keeps them in a `JITCache` with no `len()` (its dict is `.cache`), which must be counted too."""
import gc
import sys
import time
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
    cache = JITCache()
    interface = types.SimpleNamespace(_flash_attn_fwd=types.SimpleNamespace(compile_cache=cache))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.SimpleNamespace(interface=interface))
    before = compiled_kernels()
    cache[("varlen", 128)] = cache[("varlen", 64)] = object()
    assert compiled_kernels() - before == 2


def test_triton_compiles_are_counted_and_named(monkeypatch):
    """Triton's kernels can compile mid-serving too: latency.py hooks its compiler, counting and naming each."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)  # restored after the test
    monkeypatch.setattr(latency, "TRITON_COMPILES", [])
    latency.watch_triton_compiles()
    before = compiled_kernels()
    fn = types.SimpleNamespace(name="_pick_kernel")
    knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=fn, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    assert compiled_kernels() - before == 1 and latency.TRITON_COMPILES == ["_pick_kernel"]


@pytest.fixture
def gc_pauses(monkeypatch):
    """latency.GC_PAUSES, emptied, with automatic collections off; gc's callbacks and state restored after."""
    monkeypatch.setattr(latency, "GC_PAUSES", [])
    callbacks, enabled = list(gc.callbacks), gc.isenabled()
    gc.disable()
    yield latency.GC_PAUSES
    gc.callbacks[:] = callbacks
    if enabled:
        gc.enable()


def test_garbage_collections_are_timed(gc_pauses):
    """A full collection mid-serving stalls a step as a compile does: latency.py times each one."""
    latency.watch_garbage_collections()
    gc.collect()
    assert len(gc_pauses) == 1 and gc_pauses[0][1] == 2 and gc_pauses[0][0] > 0


def test_each_collection_is_timed_from_its_own_start(gc_pauses):
    """Each pause runs from its collection's start to its end, with its generation: two collections apart are each
    timed within their own gc.collect call."""
    latency.watch_garbage_collections()
    walls = []
    for generation in (0, 1):
        t = time.perf_counter()
        gc.collect(generation)
        walls.append(time.perf_counter() - t)
        time.sleep(0.05)
    assert [g for _, g in gc_pauses] == [0, 1]
    assert all(0 < pause <= wall for (pause, _), wall in zip(gc_pauses, walls))


def test_the_report_counts_the_timed_runs_collections_only(tiny_model, monkeypatch, capsys, gc_pauses):
    """A policy's reported collections are its timed run's, not start-up's, the warm-up's or an earlier policy's:
    with automatic collections off, the one collection made in each timed run is the one reported."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)  # main() hooks Triton's compiler
    monkeypatch.setattr(latency, "TRITON_COMPILES", [])
    drive = latency.drive

    async def drive_and_collect(llm, requests, rate, seed):
        results = await drive(llm, requests, rate, seed)
        if seed == 0:  # the timed run (the warm-up's seed is 1)
            gc.collect(1)
        return results
    monkeypatch.setattr(latency, "drive", drive_and_collect)
    monkeypatch.setattr(sys, "argv", ["latency.py", "--model", tiny_model, "--num-requests", "2",
                                      "--max-output-len", "4", "--rate", "100"])
    latency.main()
    reports = [line for line in capsys.readouterr().out.splitlines() if "garbage collections" in line]
    assert [line.split(":")[0] for line in reports] == ["mixed", "prefill-first"]
    assert all(", 1 garbage collections, the longest " in line and "(generation 1);" in line for line in reports)
