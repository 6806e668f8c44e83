"""A run killed part way and run again ends with every line once: kept, a torn last line cut, the rest redone."""
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import LLM
from nanovllm.batch.protocol import error_line, output_key, request_key
from nanovllm.batch.results import ResultsFile
from nanovllm.run_batch import main
from tests.batch_util import CHAT, choices, read_results, request, write_lines
from tests.conftest import greedy, within

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--kvcache-block-size", "16", "--max-num-seqs", "2"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, max_num_seqs=2) as engine:
        yield engine


def run_batch_process(args: list[str], **kwargs) -> subprocess.Popen:
    # SIGINT at its default, as in a terminal, even where pytest runs as a background job
    return subprocess.Popen([sys.executable, "-m", "nanovllm.run_batch", *args], cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def whole_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _key(line: bytes) -> str:
    obj = json.loads(line)
    return obj["custom_id"] or obj["id"]


def run(llm, inp, out, seconds: float) -> int:
    return within(seconds, main, ["-i", inp, "-o", str(out), "--model", llm.config.model, "--no-progress"], llm=llm)


PROMPTS = [f"request number {i} about the sea" for i in range(24)]


@pytest.fixture(scope="module")
def expected_texts(llm) -> list[str]:
    outputs = llm.generate(PROMPTS, greedy(40), use_tqdm=False)
    return [o["text"] for o in outputs]


@pytest.mark.parametrize("sig, status", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGINT, 130),
                                         (signal.SIGTERM, 143)])
def test_killed_part_way_then_run_again(llm, tiny_model, expected_texts, tmp_path, sig, status):
    lines = [request(f"r{i}", prompt=p, max_tokens=40, temperature=0, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    lines.insert(7, "not json")  # a bad line is written once too
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    proc = run_batch_process(["-i", inp, "-o", str(out), "--model", tiny_model, "--no-progress", *ENGINE_FLAGS],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while whole_lines(out) < 5:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no result was written in 120 s"
            time.sleep(0.01)
        proc.send_signal(sig)
        assert proc.wait(60) == status
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    if sig != signal.SIGKILL:
        assert "stopped before they finished: run the same command again" in stderr
        assert out.read_bytes().endswith(b"\n")  # a clean stop leaves whole lines
    data = out.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    keys = [_key(raw) for raw in whole.splitlines()]
    assert len(keys) == len(set(keys)) and 5 <= len(keys) < 25, "the kill came too late to test anything"
    assert run(llm, inp, out, 120) == 1
    results = read_results(out)  # no torn line, nothing twice
    assert sorted(results) == sorted([f"r{i}" for i in range(24)] + ["batch_req_line8"])
    assert results["batch_req_line8"]["error"]["code"] == "invalid_json"
    assert [choices(results[f"r{i}"])[0]["text"] for i in range(24)] == expected_texts
    assert out.read_bytes().startswith(whole)  # what the first run wrote is kept as it was


def test_stdin_to_stdout(tiny_model):
    lines = [json.dumps(request("a", prompt="Hello", max_tokens=3)), "{not json",
             json.dumps(request("b", CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=3))]
    proc = run_batch_process(["-i", "-", "-o", "-", "--model", tiny_model, *ENGINE_FLAGS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate("\n".join(lines) + "\n", timeout=120)
    assert proc.returncode == 1, stderr
    assert sorted(map(_key, stdout.splitlines())) == ["a", "b", "batch_req_line2"]  # nothing else on stdout
    assert "3 lines: 2 served, 1 failed (invalid_json 1)" in stderr


REQUESTS = [request(f"q{i}", prompt=f"short prompt {i}", max_tokens=4, temperature=0, ignore_eos=True)
            for i in range(6)]
REQUESTS[2:2] = ["{broken", json.dumps(request("q1", prompt="duplicate"))]


@pytest.fixture(scope="module")
def reference(llm, tmp_path_factory):
    """The input and a complete output of it, line by line, in the order the first run finished them."""
    folder = tmp_path_factory.mktemp("reference")
    inp = write_lines(folder / "in.jsonl", REQUESTS)
    assert run(llm, inp, folder / "out.jsonl", 120) == 1
    return inp, (folder / "out.jsonl").read_bytes().splitlines(keepends=True)


def _content(obj: dict):
    return obj["error"]["code"] if obj["error"] else choices(obj)[0]["text"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resume_after_any_kill_point(llm, reference, data):
    """A kill leaves any subset of whole results, in any order, and perhaps part of the next."""
    inp, lines = reference
    order = data.draw(st.permutations(lines))
    kept = data.draw(st.integers(0, len(order)))
    torn = data.draw(st.integers(0, len(order[kept]) - 1)) if kept < len(order) else 0
    prefix = b"".join(order[:kept])
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.jsonl"
        out.write_bytes(prefix + (order[kept][:torn] if torn else b""))
        assert run(llm, inp, out, 60) == 1  # the bad lines, in this run or the last
        assert out.read_bytes().startswith(prefix)
        results = read_results(out)
    assert sorted(results) == sorted(map(_key, lines))
    assert {k: _content(r) for k, r in results.items()} == {_key(line): _content(json.loads(line)) for line in lines}


def test_output_key_round_trip():
    # every line a run writes is recognised by a later run
    assert output_key(error_line(None, 12, "invalid_json", "x")) == request_key(None, 12)
    assert output_key(error_line("a", 12, "invalid_url", "x")) == request_key("a", 12)
    assert output_key({"id": "batch_req_lineX", "custom_id": None}) is None


def test_blank_lines_of_an_earlier_output_are_read_past(tmp_path):
    # as `echo > out.jsonl` leaves: no result, nor a foreign line that stops the run
    out = tmp_path / "out.jsonl"
    text = ('\n{"id": "batch_req_line1", "custom_id": "a", "error": null}\n\n'
            '{"id": "batch_req_line2", "custom_id": null, "error": {"code": "invalid_json"}}\n')
    out.write_text(text)
    results = ResultsFile.open(str(out))
    try:
        assert results.done == {("custom_id", "a"): False, ("line", 2): True}
    finally:
        results.close()
    assert out.read_text() == text
