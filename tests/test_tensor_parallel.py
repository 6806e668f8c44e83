"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1 and HF; engines, workers and shared memory are cleaned up."""
import functools
import gc
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import nanovllm
import nanovllm.engine.tp_channel as tp_channel
from nanovllm import SamplingParams
from nanovllm.engine import llm_engine, workers
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.workers import worker_died, worker_error
from nanovllm.layers import embed_head, linear
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests import test_models
from tests.conftest import (ROOT, assert_greedy_matches_hf, built_on_ranks, greedy, in_background, in_processes,
                            kill_the_worker_as_rank_0_sizes_its_cache, kill_worker_while_decoding, raising,
                            shm_segments, wait_until, within)

LLM = functools.partial(nanovllm.LLM, device="cpu")  # gloo, on GPU machines too (see test_gpu_*)
TP1 = functools.partial(LLM, kvcache_block_size=16)
TP2 = functools.partial(TP1, tensor_parallel_size=2)

GREEDY = greedy(10)
PROMPTS = [[7] * 3, list(range(3, 60)), list(range(100, 230)), list(range(3, 60)) + [9, 9]]


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[dict]:
    return llm.generate(prompts, params, use_tqdm=False)


def ids(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def generate_twice(llm: LLM) -> list[dict]:
    generate(llm)
    return generate(llm)  # the second call hits the prefix cache


def assert_matches_hf(hf, outputs: list[dict]):
    for prompt, out in zip(PROMPTS, outputs):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])


def tp1_ids(model: str) -> list[list[int]]:
    with TP1(model) as llm:
        return ids(generate(llm))


def assert_a_new_engine_serves(model: str):
    with TP2(model) as llm:
        assert len(generate(llm)) == len(PROMPTS)


@pytest.fixture(scope="class")
def engines(tiny_model):
    # closed before the module's other TP engines start (one a process)
    with TP1(tiny_model) as tp1, TP2(tiny_model, max_num_batched_tokens=64) as tp2:
        assert len(tp2.processes) == 1 and shm_segments()
        yield tp1, tp2
    assert shm_segments() == []


class TestOneEngineOfEach:
    def test_tp2_equals_tp1_and_hf(self, engines, hf_model):
        expected, got = map(generate_twice, engines)
        assert ids(got) == ids(expected)
        assert [o["num_cached_tokens"] for o in got] == [0, 48, 128, 48]
        assert_matches_hf(hf_model, got)

    def test_tp2_sampling_controls_equal_tp1(self, engines):
        # only rank 0 samples: the workers' sequences carry no sampling parameters
        params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, logprobs=2, max_tokens=12,
                                 ignore_eos=True),
                  SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.5, min_tokens=3,
                                 max_tokens=12, stop_token_ids=[9])] * 2
        tp1, tp2 = (generate(llm, params=params) for llm in engines)
        assert ids(tp2) == ids(tp1)
        for a, b in zip(tp1, tp2):
            assert (a["logprobs"] is None) == (b["logprobs"] is None)
            for x, y in zip(a["logprobs"] or [], b["logprobs"] or []):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


@pytest.mark.parametrize("config", [dict(vocab_size=511, tie_word_embeddings=False), dict(num_key_value_heads=1)],
                         ids=["padded-vocabulary", "one-kv-head"])
def test_a_vocabulary_or_kv_heads_that_do_not_divide_match_hf_at_tp2(tmp_path, config):
    path = make_random_checkpoint(tmp_path / "odd", "tiny", **config)
    hf = test_models.hf_model(path)
    with TP2(str(path)) as llm:
        assert llm.model_runner.attn_layers[0].num_kv_heads == 1  # of 2 or a replicated 1
        outputs = generate(llm, params=SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
        assert all(t < hf.config.vocab_size for o in outputs for t in o["token_ids"])  # never the padding row
        twice = generate_twice(llm)
    assert_matches_hf(hf, twice)


@pytest.mark.parametrize("tp", [1, 2])
def test_lm_head_writes_its_logits_into_the_buffer_it_is_given(monkeypatch, tp):
    """A decode graph's logits go into its buffer: at TP 2 rank 0's gathered vocabulary."""
    torch.manual_seed(0)
    vocab, hidden = 7, 16
    weight = torch.randn(vocab + tp - 1, hidden)  # padded to a multiple of the ranks
    heads = built_on_ranks(monkeypatch, embed_head, tp, lambda: embed_head.ParallelLMHead(vocab, hidden))
    for rank, head in enumerate(heads):
        n = head.num_embeddings_per_partition
        head.weight.data.copy_(weight.narrow(0, rank * n, n))
    x = torch.randn(3, hidden)
    parts = [x @ h.weight.t() for h in heads]  # what each rank computes, gathered on rank 0
    monkeypatch.setattr(embed_head.dist, "gather", lambda mine, into, dst: [p.copy_(q) for p, q in zip(into, parts)])
    buffer = torch.full((5, vocab), -1.0)
    got = heads[0](x, buffer[:3])
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:3], x @ weight[:vocab].t())
    assert (buffer[3:] == -1).all()  # rows past the batch untouched
    torch.testing.assert_close(heads[0](x), buffer[:3])  # without a buffer: the same logits


def test_heads_that_do_not_divide_are_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide by tensor_parallel_size=3"):
        LLM(tiny_model, tensor_parallel_size=3)
    path = make_random_checkpoint(tmp_path / "kv3", "tiny", num_attention_heads=12, num_key_value_heads=3,
                                  with_weights=False)
    with pytest.raises(ValueError, match="the model.s num_key_value_heads=3 neither divides by tensor_parallel_size=4"):
        LLM(str(path), tensor_parallel_size=4)


def at_once_on_ranks(monkeypatch, calls: list) -> list:
    """Each call's result (one a rank), run at once in threads, dist.all_reduce summing them."""
    from concurrent.futures import ThreadPoolExecutor
    barrier, parts = threading.Barrier(len(calls), timeout=10), {}

    def all_reduce(y):
        parts[threading.get_ident()] = y
        barrier.wait()
        total = torch.stack(list(parts.values())).sum(0)
        barrier.wait()
        y.copy_(total)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_row_parallel_ranks_sum_to_the_whole_layer_with_one_bias_and_one_residual(monkeypatch):
    # o_proj/down_proj: each rank holds a slice of the input
    tp, gen = 2, torch.Generator().manual_seed(0)
    weight, bias, x, residual = (torch.randn(*shape, generator=gen) for shape in ((6, 8), (6,), (3, 8), (3, 6)))
    layers = built_on_ranks(monkeypatch, linear, tp, lambda: linear.RowParallelLinear(8, 6, bias=True))
    for layer in layers:
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
    for kwargs, expected in (({}, x @ weight.T + bias), ({"residual": residual}, x @ weight.T + bias + residual)):
        for out in at_once_on_ranks(monkeypatch, [lambda layer=layer, part=part: layer(part, **kwargs)
                                                  for layer, part in zip(layers, x.chunk(tp, 1))]):
            torch.testing.assert_close(out, expected)


def test_vocab_parallel_embedding_looks_each_id_up_on_one_rank(monkeypatch):
    # 7 ids over 2 ranks of 4 rows, at a slice's edge too
    weight = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    layers = built_on_ranks(monkeypatch, embed_head, 2, lambda: embed_head.VocabParallelEmbedding(7, 4))
    for layer in layers:
        layer.weight_loader(layer.weight, weight)
    ids = torch.tensor([0, 3, 4, 6, 3])
    for rows in at_once_on_ranks(monkeypatch, [lambda layer=layer: layer(ids) for layer in layers]):
        assert torch.equal(rows, weight[ids])


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_that_read_them(monkeypatch):
    head_dim, num_heads, num_kv_heads, tp = 2, 8, 2, 4

    def ranks_of(tp, num_heads):
        return built_on_ranks(monkeypatch, linear, tp,
                              lambda: linear.QKVParallelLinear(3, head_dim, num_heads, num_kv_heads))

    weights = {name: torch.arange(heads * head_dim, dtype=torch.float32)[:, None].repeat(1, 3) + 100 * i
               for i, (name, heads) in enumerate((("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)))}
    for rank, layer in enumerate(ranks_of(tp, num_heads)):
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        for name in "qkv":
            layer.weight_loader(layer.weight, weights[name], name)
        q, k, v = layer.weight[:, 0].split([2 * head_dim, head_dim, head_dim])
        kv_head = rank * num_heads // tp // (num_heads // num_kv_heads)  # the KV head its query heads read
        assert q.tolist() == list(range(rank * 2 * head_dim, (rank + 1) * 2 * head_dim))
        assert k.tolist() == [100 + kv_head * head_dim + d for d in range(head_dim)]
        assert v.tolist() == [200 + kv_head * head_dim + d for d in range(head_dim)]
    with pytest.raises(ValueError, match="num_key_value_heads=2 neither divides by tensor_parallel_size=3"):
        ranks_of(3, num_heads=6)


def test_message_buffer_grows(tiny_model, monkeypatch):
    monkeypatch.setattr(tp_channel, "SHM_SIZE", 256)
    with TP2(tiny_model) as llm:
        out = generate(llm)
        assert llm.model_runner.channel.shm.size > 256
        assert len(shm_segments()) == 1  # the outgrown buffers are gone
    assert tp1_ids(tiny_model) == ids(out)
    assert shm_segments() == []


def worker_end(name: str, semaphores) -> tp_channel.Channel:
    tp_channel.dist.barrier = lambda: None  # one channel, no process group
    return tp_channel.Channel(name, 1, semaphores)


def _slow_worker(name: str, semaphores, queue):
    import random
    channel, received = worker_end(name, semaphores), []
    while True:
        method_name, args = channel.receive()
        if method_name == "exit":
            break
        if method_name == "_attach_shm":  # the buffer grew: what ModelRunner does
            channel.attach(*args)
            continue
        received.append(args)
        time.sleep(random.random() * 1e-3)  # still busy when rank 0 posts again
    queue.put(received)
    channel.close()


def channel_to(worker_fn, *args, monkeypatch) -> tuple[tp_channel.Channel, mp.Process]:
    """Rank 0's end of a channel; `worker_fn(name, semaphores, *args)` in a process at the other."""
    monkeypatch.setattr(tp_channel.dist, "barrier", lambda: None)
    ctx = mp.get_context("spawn")
    semaphores, name = tp_channel.channel_semaphores(ctx), f"nanovllm-{os.getpid()}-test"
    channel = tp_channel.Channel(name, 0, [semaphores])
    worker = ctx.Process(target=worker_fn, args=(name, [semaphores], *args))
    worker.start()
    return channel, worker


def calls_reach_the_worker(sent: list, monkeypatch):
    """A _slow_worker receives all `sent`: a failure, not a hang, if a post waits for good."""
    queue = mp.get_context("spawn").Queue()
    channel, worker = channel_to(_slow_worker, queue, monkeypatch=monkeypatch)

    def post_all():
        for args in sent:
            channel.post("run", *args)
        channel.post("exit")

    try:
        within(60, post_all)
        assert queue.get(timeout=60) == sent
    finally:
        worker.join(10)
        worker.kill()
        channel.close()


def test_a_call_posted_while_a_worker_is_busy_waits_for_it(monkeypatch):
    # overlap scheduling posts step N+1 while a worker may launch step N
    calls_reach_the_worker([[i, list(range(i % 50))] for i in range(300)], monkeypatch)


def test_calls_of_every_size_reach_the_worker(monkeypatch):
    monkeypatch.setattr(tp_channel, "SHM_SIZE", 256)
    calls_reach_the_worker([[b"x" * n] for n in [*range(600), 5000]], monkeypatch)  # past 256, 512, then 2 x 256


def _waiting_worker(name: str, semaphores, took_one):
    channel = worker_end(name, semaphores)
    channel.receive()
    took_one.set()
    channel.receive()  # asleep here when it is killed


def test_a_post_to_a_worker_killed_while_it_waits_does_not_block(monkeypatch):
    # (a multiprocessing Event's set() waits for every sleeper to wake: forever for a killed one)
    took_one = mp.get_context("spawn").Event()
    channel, worker = channel_to(_waiting_worker, took_one, monkeypatch=monkeypatch)
    channel.post("run", 1)
    assert took_one.wait(60)
    time.sleep(0.5)  # asleep, waiting for the next call
    worker.kill()
    worker.join(10)
    within(5, channel.post, "run", 2)  # the buffer was taken: this post goes through
    channel.abort()  # as the engine's watch does: the next post raises
    with pytest.raises(RuntimeError, match="worker is gone"):
        within(5, channel.post, "run", 3)
    channel.close()


class FailsOnTheWorker:
    """Raises as the worker reads it."""

    def __reduce__(self):
        return exec, ("raise RuntimeError('out of memory on the worker')",)


def test_worker_error_is_kept_for_later_calls_and_a_closed_pipe_is_none():
    reader, writer = mp.Pipe(duplex=False)
    process = SimpleNamespace(errors=reader, error=None, exitcode=1, pid=123)
    assert worker_error(process) is None  # nothing said yet
    writer.send("RuntimeError: boom")
    assert worker_error(process) == worker_error(process) == "RuntimeError: boom"  # read once and kept
    assert "died with exit code 1 after RuntimeError: boom;" in str(worker_died(1, process))
    closed_reader, closed_writer = mp.Pipe(duplex=False)
    closed_writer.close()  # a worker that ended without a word
    assert worker_error(SimpleNamespace(errors=closed_reader, error=None)) is None
    closed_reader.close()
    assert worker_error(SimpleNamespace(errors=closed_reader, error=None)) is None


def killed_by(sig: int):
    def kill(llm: LLM):
        generate(llm, PROMPTS[:1])
        os.kill(llm.processes[0].pid, sig)
    return kill


def sent_a_call_that_fails_on_the_worker(llm: LLM):
    llm.model_runner.channel.post("run", FailsOnTheWorker())


@pytest.mark.parametrize("end, error, stderr, seconds", [
    (killed_by(signal.SIGKILL), "-9", [], 5),
    # as a crash in a kernel library: the worker's stack on its stderr
    (killed_by(signal.SIGSEGV), "-11", ["Fatal Python error: Segmentation fault", "model_runner.py"], 5),
    # the worker's own exception is named beside its exit code
    (sent_a_call_that_fails_on_the_worker, "-?[0-9]+ after RuntimeError: out of memory on the worker; close this "
     "engine", ["Traceback", "RuntimeError: out of memory on the worker"], 30),
], ids=["killed", "crashed", "raised"])
def test_a_worker_that_dies_is_named_in_an_error_not_a_hang(tiny_model, capfd, end, error, stderr, seconds):
    llm = TP2(tiny_model)
    end(llm)
    within(30, llm.processes[0].join)  # (beside the engine's own watch, which reaps it too)
    assert llm.processes[0].exitcode != 0
    for _ in range(2):  # the first call and a later one
        with pytest.raises(RuntimeError, match=f"worker rank 1 .* died with exit code {error}"):
            within(seconds, generate, llm)
    within(30, llm.close)
    assert shm_segments() == []
    with pytest.raises(RuntimeError, match="closed"):
        generate(llm)
    err = capfd.readouterr().err
    assert all(line in err for line in stderr), err


RANK_0_DIES = """
import os, signal, sys, time
import torch.distributed as dist
from nanovllm import LLM

def die(*args):
    if sys.argv[2] == "in-a-step":  # its connections close before its pipes (as a dying process's may)
        dist.destroy_process_group()
        time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)

llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
llm.generate([[5, 6, 7]])
if sys.argv[2] == "in-a-step":  # the worker waits in the step's collective
    llm.model_runner.model.model.embed_tokens.forward = die
    llm.generate([[5, 6, 7]])
die()
"""


@pytest.mark.parametrize("when", ["idle", "in-a-step"])
def test_a_worker_whose_rank_0_died_exits_quietly(tiny_model, when):
    # it told rank 0 why it ended through a pipe closed by rank 0's death: a BrokenPipeError traceback
    done = subprocess.run([sys.executable, "-c", RANK_0_DIES, tiny_model, when], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # (returns once the worker, which shares its stderr, has exited)
    assert done.returncode == -signal.SIGKILL  # (the resource tracker cleans up after rank 0)
    assert all("resource_tracker" in line or "warnings.warn" in line for line in done.stderr.splitlines()), done.stderr


def kill_the_new_worker(monkeypatch):
    before = set(mp.active_children())

    def kill():
        wait_until(lambda: set(mp.active_children()) - before)
        os.kill((set(mp.active_children()) - before).pop().pid, signal.SIGKILL)
    in_background(kill)


@pytest.mark.parametrize("kill, seconds", [(kill_the_new_worker, 30), (kill_the_worker_as_rank_0_sizes_its_cache, 60)])
def test_a_worker_that_dies_while_the_engine_starts_is_named(tiny_model, monkeypatch, kill, seconds):
    # as it starts, or while rank 0 waits in a collective (the start-up watch aborts it)
    kill(monkeypatch)
    with pytest.raises(RuntimeError, match="worker rank 1 .* died with exit code -9"):
        within(seconds, LLM, tiny_model, tensor_parallel_size=2)
    monkeypatch.undo()
    assert_a_new_engine_serves(tiny_model)
    assert shm_segments() == []


def test_beside_a_tp_engine_a_second_is_refused_and_a_tp1_one_runs_apart(tiny_model, monkeypatch):
    with TP2(tiny_model) as tp2:
        with pytest.raises(RuntimeError, match="another engine"):
            LLM(tiny_model, tensor_parallel_size=2)
        # its layers took the group's rank and size (half of each, collectives nobody answered: a hang)
        with TP1(tiny_model) as tp1:
            assert ids(within(60, generate, tp1)) == ids(within(60, generate, tp2))
        monkeypatch.setattr(ModelRunner, "allocate_kv_cache", raising(ValueError("injected")))
        with pytest.raises(ValueError, match="injected"):  # closed or failing to start, it leaves the group
            LLM(tiny_model)
        assert dist.is_initialized() and len(within(60, generate, tp2)) == len(PROMPTS)
    monkeypatch.undo()
    assert_a_new_engine_serves(tiny_model)  # fine once the first is closed


def test_a_new_tp_engine_waits_for_an_earlier_ones_collectives_abort(tiny_model, monkeypatch):
    # NCCL's abort may take 30 s and tear down engines started meanwhile
    monkeypatch.setattr(workers, "ABORT_WAIT", 1.0)
    with workers.COLLECTIVES_ABORT:  # an abort that does not end
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="NCCL has not torn its process group down after 1 s; start a new "
                                               "process"):
            LLM(tiny_model, tensor_parallel_size=2)
        assert time.monotonic() - started < 10
    threading.Timer(0.5, workers.COLLECTIVES_ABORT.release).start()
    workers.COLLECTIVES_ABORT.acquire()  # an abort that ends in 0.5 s: the engine starts after
    with TP2(tiny_model) as llm:
        assert not workers.COLLECTIVES_ABORT.locked()
        assert len(generate(llm)) == len(PROMPTS)


def test_an_error_on_rank_0_mid_step_ends_the_engine_without_a_hang(tiny_model):
    # the worker waits in a collective for good: later calls say why, close() does not wait
    llm = TP2(tiny_model)
    generate(llm, PROMPTS[:1])
    embed = llm.model_runner.model.model.embed_tokens
    embed.forward = raising(ValueError("injected on rank 0"))
    with pytest.raises(ValueError, match="injected on rank 0"):
        within(30, generate, llm)
    del embed.forward
    with pytest.raises(RuntimeError, match="rank 0 failed in a step .*ValueError.*injected on rank 0.*close this "
                                           "engine"):
        within(30, generate, llm)
    assert_closes_within_15s(llm)
    assert not llm.processes[0].is_alive()


def test_a_segment_left_under_this_pid_by_a_killed_process_is_not_this_ones():
    # a killed run's segment under the pid a later pytest got failed 18 of this file's tests
    code = ("import os, multiprocessing.shared_memory as m; from tests.conftest import shm_segments; s = m.SharedMemory"
            "(f'nanovllm-{os.getpid()}-new', create=True, size=1); print(shm_segments()); s.unlink()")
    with subprocess.Popen(["bash", "-c", 'touch /dev/shm/nanovllm-$$-old && exec "$0" -c "$1"', sys.executable, code],
                          cwd=ROOT, stdout=subprocess.PIPE, text=True) as shell:  # bash's pid is python's
        try:
            out = shell.communicate(timeout=120)[0]
        finally:
            Path(f"/dev/shm/nanovllm-{shell.pid}-old").unlink(missing_ok=True)
    assert out.split() == [f"['nanovllm-{shell.pid}-new']"]


def step_held_on_rank_0(llm: LLM) -> tuple[threading.Thread, dict, threading.Event]:
    """A step() in the background, held in rank 0's forward until the event returned is set."""
    llm.add_request(PROMPTS[1], GREEDY)
    embed = llm.model_runner.model.model.embed_tokens
    forward, entered, release = embed.forward, threading.Event(), threading.Event()

    def waits(*args):
        entered.set()
        release.wait(60)
        return forward(*args)

    embed.forward = waits
    stepping, stepped = in_background(llm.step)
    assert entered.wait(30)
    return stepping, stepped, release


@pytest.mark.parametrize("tp", [1, 2])
def test_close_waits_for_a_step_that_a_caller_runs_in_another_thread(tiny_model, tp):
    # a second close() meanwhile waits too
    llm = TP1(tiny_model, tensor_parallel_size=tp)
    stepping, stepped, release = step_held_on_rank_0(llm)

    def close_and_look():
        llm.close()
        return shm_segments(), [process.is_alive() for process in llm.processes], llm.model_runner.kv_cache
    closing, closed = in_background(close_and_look)
    closing.join(0.5)
    again, closed_again = in_background(close_and_look)
    again.join(0.5)
    assert closing.is_alive() and again.is_alive()  # waiting for the step
    release.set()
    for thread in (stepping, closing, again):
        thread.join(30)
        assert not thread.is_alive()
    assert "error" not in stepped
    assert closed["value"] == closed_again["value"] == ([], [False] * (tp - 1), None)  # all gone as each returned
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.step()
    assert shm_segments() == [] and not any(process.is_alive() for process in llm.processes)


def test_an_interrupt_while_close_waits_for_a_step_kills_the_workers_without_an_exit(tiny_model, monkeypatch):
    # not told to exit: the exit's barrier and the step's collectives would wait for each other
    llm = TP2(tiny_model)
    stepping, _, release = step_held_on_rank_0(llm)
    stop = llm._loop.stop

    def interrupted(timeout):  # the ^C comes while stop() waits for the step
        stop(0.2)
        raise KeyboardInterrupt
    monkeypatch.setattr(llm._loop, "stop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        within(10, llm.close)
    within(10, llm.processes[0].join)
    assert shm_segments() == []
    release.set()
    stepping.join(30)


def test_a_terminals_ctrl_c_leaves_the_worker_to_rank_0(tiny_model):
    with TP2(tiny_model) as llm:  # a terminal signals the whole process group: the worker too
        os.kill(llm.processes[0].pid, signal.SIGINT)
        time.sleep(1)
        assert llm.processes[0].is_alive() and len(within(30, generate, llm)) == len(PROMPTS)


@pytest.mark.parametrize("when, owner, name, after", [
    ("close", dist, "barrier", True),  # (a C call raises as it returns)
    ("close", tp_channel.Channel, "close", False),
    ("close", workers.WorkerWatch, "stop", False),
    ("build", tp_channel.Channel, "__init__", True),  # rank 0's buffer made
    ("build", workers.WorkerWatch, "stop", False),  # the start-up watch's
    ("build", llm_engine, "Scheduler", False),  # close() not set up yet
], ids=["close-barrier", "close-channel", "close-watch", "build-channel", "build-watch", "build-engine"])
def test_a_ctrl_c_as_an_engine_starts_or_closes_leaves_nothing_behind(tiny_model, monkeypatch, when, owner, name,
                                                                     after):
    llm = TP2(tiny_model) if when == "close" else None
    real = getattr(owner, name)

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(owner, name, real)
        if after:
            real(*args, **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(owner, name, interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        within(60, llm.close) if llm else within(60, TP2, tiny_model)
    assert time.monotonic() - start < 5 and getattr(owner, name) is real
    time.sleep(0.5)
    assert mp.active_children() == shm_segments() == [] and not dist.is_initialized() and not gc.get_freeze_count()
    assert_a_new_engine_serves(tiny_model)


def test_an_error_on_rank_0_between_steps_leaves_a_tp_engine_usable(tiny_model):
    # in the bookkeeping after a step's collectives: the worker stays in step
    with TP2(tiny_model) as llm:
        expected = ids(generate(llm))
        complete, llm.scheduler.complete = llm.scheduler.complete, raising(ValueError("injected after the step"))
        with pytest.raises(ValueError, match="injected after the step"):
            within(30, generate, llm)
        llm.scheduler.complete = complete
        assert ids(within(30, generate, llm)) == expected


def _engine_in_a_process(model: str, queue):
    with TP2(model) as llm:
        token_ids = ids(generate(llm))
    queue.put((token_ids, shm_segments()))


def test_two_engines_at_once_on_one_host(tiny_model):
    results = in_processes(_engine_in_a_process, tiny_model)
    assert results == [(tp1_ids(tiny_model), [])] * 2  # neither left shared memory behind


def assert_freed_within_5s(thread: threading.Thread, killed: float):
    thread.join(5)
    assert not thread.is_alive(), "generate still blocked 5 s after the worker died"
    assert time.monotonic() - killed < 5


def assert_closes_within_15s(llm: LLM):
    start = time.monotonic()
    within(30, llm.close)
    assert time.monotonic() - start < 15
    assert shm_segments() == []


def test_worker_killed_mid_generate_fails_it_within_5s(tiny_model, monkeypatch):
    llm = TP2(tiny_model)
    thread, outcome, killed = kill_worker_while_decoding(llm, PROMPTS, greedy(3000))
    assert_freed_within_5s(thread, killed)
    # named, whether the watch or the step's broken collective came first
    assert re.search("worker rank 1 .* died", str(outcome.get("error"))), outcome
    with pytest.raises(RuntimeError, match="worker rank 1 .* died"):
        llm.submit(PROMPTS[0])
    # the socket closes before the process is reaped: close() may see it alive
    monkeypatch.setattr(llm.processes[0], "is_alive", lambda: True)
    assert_closes_within_15s(llm)


def test_a_step_stuck_in_a_collective_is_freed_when_a_worker_dies(tiny_model):
    # as with NCCL: the step waits for the engine's watch to abort the collectives
    llm = TP2(tiny_model)
    collectives_aborted, in_step, failed_first = threading.Event(), threading.Event(), []
    # the requests fail before the step is freed (a freed collective's results are garbage)
    llm.model_runner.abort_collectives = lambda: (failed_first.append(llm._loop.error), collectives_aborted.set())
    run = llm.model_runner.run

    def stuck_run(seqs):
        if len(seqs[0]) > len(PROMPTS[0]) + 5:  # decoding for a while: stick
            in_step.set()
            collectives_aborted.wait()
        return run(seqs)

    llm.model_runner.run = stuck_run
    thread, outcome = in_background(generate, llm, PROMPTS[:1], greedy(50))
    assert in_step.wait(60)
    os.kill(llm.processes[0].pid, signal.SIGKILL)
    assert_freed_within_5s(thread, time.monotonic())
    assert collectives_aborted.is_set()
    assert len(failed_first) == 1 and "worker rank 1" in str(failed_first[0])
    assert "worker rank 1" in str(outcome.get("error")) and "died" in str(outcome["error"])
    with pytest.raises(RuntimeError, match="worker rank 1 .* died"):
        llm.submit(PROMPTS[0])
    assert_closes_within_15s(llm)
