"""nanovllm.ray on a local 2-CPU Ray cluster: two replicas give what one engine gives, run_batch
--data-parallel-size resumes like the one-engine runner, and a killed replica's batch is retried."""
import json
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from nanovllm import LLM
from nanovllm.run_batch import main
from tests.batch_util import (CHAT, choices, main_here, poison_at_submit, read_results, request,
                              tear_first_line_then_signal, write_lines)
from tests.conftest import greedy, within

ray = pytest.importorskip("ray")  # the test extra has it; the GPU machine does not

ENGINE_ARGS = dict(kvcache_block_size=16, max_model_len=128)
GREEDY = greedy(8)
CONVERSATION = [{"role": "user", "content": "Hello!"}]


def dp_flags(model: str) -> list[str]:
    return ["--model", model, "--no-progress", "--kvcache-block-size", "16", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, **ENGINE_ARGS) as engine:
        yield engine


def test_two_replicas_equal_one_engine(ray_cluster, llm, tiny_model):
    from nanovllm.ray import generate
    def row(i, prompt=None, messages=None, sampling_params=None):
        return {"id": i, "prompt": prompt, "messages": messages, "sampling_params": sampling_params}
    rows = [row(i, f"The sea number {i}") for i in range(6)] + [
        row(6, messages=CONVERSATION, sampling_params={"temperature": 0.0}),
        row(7, "Short one", sampling_params={"max_tokens": 3}),
        row(8, "word " * 200), row(9), row(10, "x", CONVERSATION),  # too long, nothing to serve, both: errors
        row(11, messages=[{"role": "user", "content": None}])]
    dataset = ray.data.from_items(rows)
    out = within(300, lambda: generate(dataset, tiny_model, GREEDY, concurrency=2, batch_size=3,
                                              **ENGINE_ARGS).take_all())
    got = {row["id"]: row for row in out}
    assert sorted(got) == list(range(12))
    expected = llm.generate([f"The sea number {i}" for i in range(6)], GREEDY, use_tqdm=False)
    expected += llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    expected += llm.generate(["Short one"], greedy(3), use_tqdm=False)
    for i, out in enumerate(expected):
        row = got[i]
        assert row["error"] is None
        assert (row["generated_text"], list(row["generated_token_ids"]), row["finish_reason"]) == \
            (out["text"], out["token_ids"], out["finish_reason"])
    assert got[6]["num_prompt_tokens"] == len(llm.apply_chat_template(CONVERSATION))
    assert "max_model_len=128" in got[8]["error"] and "'role'" in got[11]["error"]
    assert all("'prompt' or a 'messages'" in got[i]["error"] for i in (9, 10))
    assert list(got[8]["generated_token_ids"]) == [] and got[8]["prompt"].startswith("word")  # input columns stay


def test_run_batch_on_two_replicas_equals_one_engine_and_resumes(ray_cluster, llm, tiny_model, tmp_path, monkeypatch,
                                                                  capsys):
    lines = [request(f"r{i}", prompt=f"The moon {i}", max_tokens=6, temperature=0, ignore_eos=True) for i in range(7)]
    lines += [request("chat", CHAT, messages=CONVERSATION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=1),
              "not json", request("r1", prompt="duplicate"), request("long", prompt=list(range(3, 200)))]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    flags = dp_flags(tiny_model)
    assert within(120, main, ["-i", inp, "-o", str(tmp_path / "one.jsonl"), *flags], llm=llm) == 1
    one = read_results(tmp_path / "one.jsonl")
    # a data-parallel run killed after three results, the last torn; this run reports the bad lines
    kept = [line for line in (tmp_path / "one.jsonl").read_bytes().splitlines(keepends=True)
            if json.loads(line)["error"] is None][:4]
    (tmp_path / "dp.jsonl").write_bytes(b"".join(kept[:3]) + kept[3][:20])
    argv = ["-i", inp, "-o", str(tmp_path / "dp.jsonl"), *flags, "--data-parallel-size", "2", "--max-in-flight", "4"]
    blocks, from_arrow_refs = [], ray.data.from_arrow_refs
    monkeypatch.setattr(ray.data, "from_arrow_refs", lambda refs: blocks.append(len(refs)) or from_arrow_refs(refs))
    assert within(300, main, argv) == 1
    err = capsys.readouterr().err  # counted as by one engine
    assert "5 served, 3 failed (duplicate_custom_id 1, invalid_json 1, prompt_too_long 1)" in err
    assert "; 29 completion tokens" in err
    # 6 requests left (1 too long, as only an engine measures), a block per 2: one block would idle a replica
    assert blocks == [3]
    dp = read_results(tmp_path / "dp.jsonl")
    assert sorted(dp) == sorted(one)

    def content(result):
        if result["error"]:
            return result["error"]["code"]
        return [(c.get("text") or c["message"]["content"], c["finish_reason"],
                 c["logprobs"] and [e["token"] for e in c["logprobs"]["content"]]) for c in choices(result)]
    assert {k: content(r) for k, r in dp.items()} == {k: content(r) for k, r in one.items()}

    def logprobs(result):  # equal up to float rounding: a replica's torch runs on fewer threads
        return [e["logprob"] for e in choices(result)[0]["logprobs"]["content"]]
    assert logprobs(dp["chat"]) == pytest.approx(logprobs(one["chat"]), abs=1e-4)
    assert (tmp_path / "dp.jsonl").read_bytes().startswith(b"".join(kept[:3]))


def test_a_signal_never_cuts_a_replicas_result_line(ray_cluster, tiny_model, tmp_path, monkeypatch, capsys):
    """As with one engine (test_run_batch), and the requests not back yet are counted as stopped."""
    inp = write_lines(tmp_path / "in.jsonl", [request(f"r{i}", prompt=f"p {i}", max_tokens=2) for i in range(4)])
    signalled = tear_first_line_then_signal(monkeypatch)
    argv = ["-i", inp, "-o", str(tmp_path / "out.jsonl"), *dp_flags(tiny_model), "--data-parallel-size", "2",
            "--max-in-flight", "2"]
    assert main_here(argv) == 143
    monkeypatch.undo()
    assert signalled and len(read_results(tmp_path / "out.jsonl")) == 1
    err = capsys.readouterr().err
    assert "1 served" in err and "3 stopped before" in err, err


def _busy_replicas() -> list[int]:
    """pids of replica processes running a batch now (Ray titles a process by the task it runs)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if title.startswith(b"ray::MapWorker(MapBatches(_GenerateReplica)).submit"):
            pids.append(int(pid))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds Ray's workers through /proc")
def test_a_killed_replica_batch_is_retried(ray_cluster, llm, tiny_model):
    from nanovllm.ray import generate
    prompts = [f"A long story number {i}" for i in range(4)]
    params = greedy(100)
    dataset = ray.data.from_items([{"prompt": p} for p in prompts])
    box = {}
    runner = threading.Thread(target=lambda: box.setdefault("rows", generate(
        dataset, tiny_model, params, concurrency=1, batch_size=2, **ENGINE_ARGS).take_all()), daemon=True)
    runner.start()
    killed, deadline = None, time.monotonic() + 240
    while killed is None and runner.is_alive() and time.monotonic() < deadline:
        busy = _busy_replicas()
        if busy:
            os.kill(busy[0], signal.SIGKILL)  # mid-batch: its rows are in its engine, none returned yet
            killed = busy[0]
        time.sleep(0.005)
    runner.join(max(deadline - time.monotonic(), 1))
    assert killed is not None, "no replica was seen running a batch"
    assert not runner.is_alive(), "the dataset did not finish after its replica was killed"
    rows = box["rows"]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert sorted((r["prompt"], r["generated_text"]) for r in rows) == \
        sorted(zip(prompts, (o["text"] for o in expected)))


def test_a_cluster_without_the_resources_fails_instead_of_waiting(ray_cluster, tiny_model, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [request("a", prompt="x", max_tokens=2)])
    argv = ["-i", inp, "-o", str(tmp_path / "out"), "--model", tiny_model, "--no-progress", "--device", "cuda",
            "--data-parallel-size", "2", "--ray-start-timeout", "1"]
    assert within(120, main, argv) == 3  # this cluster has no GPU (num_gpus=0)
    assert "Timed out while starting actors" in capsys.readouterr().err


def test_without_ray_the_error_says_how_to_get_it(tiny_model, tmp_path, monkeypatch, capsys):
    import nanovllm.ray
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'nano-vllm\[ray\]'"):
        nanovllm.ray.generate(None, tiny_model)
    inp = write_lines(tmp_path / "in.jsonl", [request("a", prompt="x")])
    assert main(["-i", inp, "-o", str(tmp_path / "out"), "--model", tiny_model, "--data-parallel-size", "2"]) == 2
    assert "pip install 'nano-vllm[ray]'" in capsys.readouterr().err


def test_an_engine_failure_aborts_the_batch_left_unfinished():
    from nanovllm.ray import _Replica
    aborted = []
    handles = [SimpleNamespace(result=lambda: 1 / 0, finished=i == 1, abort=lambda i=i: aborted.append(i),
                               failed_alone=False) for i in range(3)]
    with pytest.raises(ZeroDivisionError):
        _Replica._collect(None, [None, *handles])
    assert aborted == [0, 2]


def test_a_row_that_fails_on_its_own_is_its_error_not_the_batchs(llm, monkeypatch):
    import pyarrow as pa
    from nanovllm.ray import _GenerateReplica
    replica = object.__new__(_GenerateReplica)  # on this engine, outside Ray
    replica.llm, replica.params, replica.chat_template = llm, GREEDY, None
    poison_at_submit(llm, monkeypatch, "bad")
    rows = within(60, replica, pa.table({"prompt": ["good", "bad"]})).to_pylist()
    assert rows[0]["error"] is None and len(rows[0]["generated_token_ids"]) == GREEDY.max_tokens
    assert "injected undecodable token" in rows[1]["error"] and rows[1]["generated_token_ids"] == []


def test_a_replica_without_sampling_params_takes_the_models_defaults(monkeypatch):
    from nanovllm.ray import _GenerateReplica, _Replica
    monkeypatch.setattr(_Replica, "__init__", lambda self, *_: setattr(self, "llm", SimpleNamespace(
        sampling_defaults={"top_k": 3})))
    assert _GenerateReplica("m", {}, None, None).params.top_k == 3  # as LLM.generate's None


def test_a_replica_reserves_a_cpu_or_a_gpu_per_rank(monkeypatch):
    from nanovllm.ray import _map_replicas
    for gpus, cpus in ((0, 2), (2, 1)):
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": gpus})
        got, data = {}, SimpleNamespace()
        data.map_batches = lambda _, **kw: got.update(kw) or SimpleNamespace(context=data)
        _map_replicas(data, 0, 0, {"tensor_parallel_size": 2}, 1, 1, 0, 0, 1)
        assert (got.get("num_gpus", 0), got["num_cpus"]) == (gpus, cpus)


@pytest.mark.parametrize("bad", [dict(concurrency=True), dict(batch_size=0), dict(start_timeout_s=1.5)])
def test_bad_replica_settings_are_refused(tiny_model, bad):
    from nanovllm.ray import generate
    with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* must be an int >= 1"):
        generate(None, tiny_model, **bad)
