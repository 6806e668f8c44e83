"""Helpers of the benchmark scripts that decide what their tables say."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_decode import chain  # noqa: E402


def test_chain_charges_each_kernel_what_it_adds_to_the_critical_path():
    """Overlapping records (dependent launches) add only what runs past the latest end; a short idle gap inside a
    step counts to the kernel after it, a step boundary's does not; records come in any order."""
    spans = [
        ("gemm", 100.0, 104.0),  # the next step, after a boundary gap of 82 us: adds its 4 us only
        ("attn", 2.0, 15.0),  # launched early, ends 5 us after qkv
        ("qkv", 0.0, 10.0),
        ("merge<float>", 3.0, 12.0),  # ends inside attention's span: adds nothing
        ("attn", 16.0, 18.0),  # 1 us idle, then 2 us
    ]
    rows = {name: (per_step, us) for name, per_step, us in chain(spans, steps=2)}
    assert rows == {"qkv": (0.5, 5.0), "attn": (1.0, 4.0), "merge": (0.5, 0.0), "gemm": (0.5, 2.0)}
    assert [name for name, *_ in chain(spans, steps=2)] == ["qkv", "attn", "gemm", "merge"]
