"""Helpers of the benchmark scripts that decide what their tables say."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_decode import chain, largest_gaps  # noqa: E402


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


def test_largest_gaps_name_the_record_that_ended_last_before_each():
    """Idle gaps over STEP_GAP_US, longest first, each from the record that ended last (not started last) to the
    next to start; shorter ones and overlaps are no gaps; records come in any order."""
    records = [
        ("copy", 500.0, 505.0),  # 300 us after long's end
        ("short", 10.0, 20.0),  # starts after long, ends before it
        ("long", 0.0, 200.0),
        ("norm", 610.0, 620.0),  # 105 us after copy
        ("add", 630.0, 640.0),  # 10 us: inside a step
    ]
    assert largest_gaps(records, 5) == [(300.0, "long", "copy"), (105.0, "copy", "norm")]
    assert largest_gaps(records, 1) == [(300.0, "long", "copy")]


def test_latency_names_its_runs_and_splits_first_tokens_and_device_time():
    """latency.py's runs in order (a mixed one per budget, a repeated name numbered), a first token's three parts
    over the requests whose prompt step was seen, and the device's work and idle time by kind of step."""
    from latency import DEFAULT_BUDGET, device_parts, first_token_parts, make_requests, plan_runs
    timed, warmup = make_requests(20, 128, 512)  # the warm-up's leave no prefix cache for them
    assert [len(p) for p, _ in warmup] == [len(p) for p, _ in timed[:16]]
    assert not {tuple(p[:16]) for p, _ in warmup} & {tuple(p[:16]) for p, _ in timed}
    assert plan_runs(["mixed", "prefill-first", "mixed"], [DEFAULT_BUDGET]) == [
        ("mixed", False, DEFAULT_BUDGET), ("prefill-first", True, DEFAULT_BUDGET),
        ("mixed (run 2)", False, DEFAULT_BUDGET)]
    assert plan_runs(["mixed", "prefill-first"], [512, 2048]) == [
        ("mixed, budget 512", False, 512), ("mixed, budget 2048", False, 2048),
        ("prefill-first", True, DEFAULT_BUDGET)]
    prompts = {tuple(range(16)): (1.002, 1.003)}  # scheduled 2 ms after the request came, launched 1 ms later
    results = [(0.010, [], 1.0), (0.5, [], 0.0)]  # the second's prompt step was not seen: left out
    requests = [(list(range(20)), None), (list(range(1, 21)), None)]
    assert first_token_parts(results, requests, prompts) == \
        "wait for a step 2.00 / 2.00, schedule and launch 1.00 / 1.00, launch to first token 7.00 / 7.00 (1 requests)"

    class Event(float):  # a recorded CUDA event, at this many ms
        def elapsed_time(self, other):
            return other - self
    steps = [(0, 1, False), (1.5, 4.5, True), (4.5, 5.5, False), (6, 7, True)]  # (start, end, prompt tokens)
    assert device_parts([(Event(a), Event(b), prompt) for a, b, prompt in steps]) == (
        "with prompt tokens (2): work 2.00 / 2.80, idle before 0.50 / 0.50; after one (1): work 1.00 / 1.00, "
        "idle before 0.00 / 0.00; other (1): work 1.00 / 1.00, idle before 0.00 / 0.00")


def test_bench_names_a_min_len_over_a_maximum(capsys):  # not randint's error
    import bench
    with pytest.raises(SystemExit):
        bench.main(["--max-input-len", "32", "--max-output-len", "8"])
    assert "--min-len 100 is over --max-input-len 32" in capsys.readouterr().err
