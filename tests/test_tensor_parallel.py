"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1 and HF; engines, workers and shared memory are cleaned up."""
import functools
import multiprocessing as mp
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

import nanovllm
import nanovllm.engine.tp_channel as tp_channel
from nanovllm import SamplingParams
from nanovllm.engine.workers import worker_died, worker_error
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import (assert_greedy_matches_hf, built_on_ranks, in_background, in_processes,
                            kill_the_worker_as_rank_0_sizes_its_cache, kill_worker_while_decoding, shm_segments,
                            within)

LLM = functools.partial(nanovllm.LLM, device="cpu")  # gloo, also on a machine with GPUs (their tests: test_gpu_*)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[7] * 3, list(range(3, 60)), list(range(100, 230)), list(range(3, 60)) + [9, 9]]


def generate_twice(llm: LLM) -> list[dict]:
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the second call hits the prefix cache


@pytest.fixture(scope="class")
def engines(tiny_model):
    """A TP=1 and a TP=2 engine for the tests of one class: a TP engine's start (its worker imports everything) is
    most of their time. Class-scoped, so both are closed before the module's other tests start TP engines of their
    own (a process runs one at a time)."""
    with LLM(tiny_model, kvcache_block_size=16) as tp1, \
            LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2, max_num_batched_tokens=64) as tp2:
        assert len(tp2.processes) == 1 and shm_segments()
        yield tp1, tp2
    assert shm_segments() == []


class TestOneEngineOfEach:
    """TP=2 against TP=1, on the same two engines."""

    def test_tp2_equals_tp1_and_hf(self, engines, hf_model):
        tp1, tp2 = engines
        expected, got = generate_twice(tp1), generate_twice(tp2)
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]
        assert [o["num_cached_tokens"] for o in got] == [0, 48, 128, 48]
        for prompt, out in zip(PROMPTS, got):
            assert_greedy_matches_hf(hf_model, prompt, out["token_ids"])

    def test_tp2_sampling_controls_equal_tp1(self, engines):
        # only rank 0 samples: the workers' copies of a sequence carry no sampling parameters
        params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, logprobs=2, max_tokens=12,
                                 ignore_eos=True),
                  SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.5, min_tokens=3,
                                 max_tokens=12, stop_token_ids=[9])] * 2
        tp1, tp2 = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in engines)
        assert [o["token_ids"] for o in tp2] == [o["token_ids"] for o in tp1]
        for a, b in zip(tp1, tp2):
            assert (a["logprobs"] is None) == (b["logprobs"] is None)
            for x, y in zip(a["logprobs"] or [], b["logprobs"] or []):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_vocabulary_that_does_not_divide_is_padded(tmp_path):
    from transformers import AutoModelForCausalLM
    path = make_random_checkpoint(tmp_path / "odd-vocab", "tiny", vocab_size=511, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with LLM(str(path), kvcache_block_size=16, tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)
        assert all(t < 511 for o in outputs for t in o["token_ids"])  # the padding row is never sampled
        greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, greedy):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])


@pytest.mark.parametrize("tp", [1, 2])
def test_lm_head_writes_its_logits_into_the_buffer_it_is_given(monkeypatch, tp):
    """A decode graph's logits go straight into its buffer: at TP 2 rank 0's gathered vocabulary, padding cut."""
    import torch
    from nanovllm.layers import embed_head
    torch.manual_seed(0)
    vocab, hidden = 7, 16
    weight = torch.randn(vocab + tp - 1, hidden)  # padded to a multiple of the ranks
    heads = []
    for rank in range(tp):
        monkeypatch.setattr(embed_head, "tp_rank", lambda: rank)
        monkeypatch.setattr(embed_head, "tp_size", lambda: tp)
        head = embed_head.ParallelLMHead(vocab, hidden)
        head.weight.data.copy_(weight.narrow(0, rank * head.num_embeddings_per_partition,
                                             head.num_embeddings_per_partition))
        heads.append(head)
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


def ranks_of(monkeypatch, tp: int, **layer_args) -> list:
    """The QKV layer of each of `tp` ranks, built as that rank would build it (no process group needed)."""
    from nanovllm.layers import linear
    return built_on_ranks(monkeypatch, linear, tp, lambda: linear.QKVParallelLinear(**layer_args))


def at_once_on_ranks(monkeypatch, calls: list) -> list:
    """What each call (one a rank) returns when they run at once in threads, dist.all_reduce summing across them:
    the ranks of a layer without a process group."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    import torch
    import torch.distributed as dist
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
    """Each rank of a row-parallel projection (o_proj, down_proj) holds a slice of the input dimension; summed over
    the ranks, the output is the whole layer's, its bias counted once and the residual added once (the residual is
    what the GPU's decode steps pass; the CPU engines never do)."""
    import torch
    from nanovllm.layers import linear
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
    """A vocabulary of 7 over 2 ranks (4 rows each, the last one padding): every id, those at the edge of a rank's
    slice included, gets its own row, from the rank that holds it."""
    import torch
    from nanovllm.layers import embed_head
    weight = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    layers = built_on_ranks(monkeypatch, embed_head, 2, lambda: embed_head.VocabParallelEmbedding(7, 4))
    for layer in layers:
        layer.weight_loader(layer.weight, weight)
    ids = torch.tensor([0, 3, 4, 6, 3])
    for rows in at_once_on_ranks(monkeypatch, [lambda layer=layer: layer(ids) for layer in layers]):
        assert torch.equal(rows, weight[ids])


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_that_read_them(monkeypatch):
    import torch
    head_dim, num_heads, num_kv_heads, tp = 2, 8, 2, 4
    weights = {name: torch.arange(heads * head_dim, dtype=torch.float32)[:, None].repeat(1, 3) + 100 * i
               for i, (name, heads) in enumerate((("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)))}
    for rank, layer in enumerate(ranks_of(monkeypatch, tp, hidden_size=3, head_dim=head_dim, num_heads=num_heads,
                                          num_kv_heads=num_kv_heads)):
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        for name in "qkv":
            layer.weight_loader(layer.weight, weights[name], name)
        q, k, v = layer.weight[:, 0].split([2 * head_dim, head_dim, head_dim])
        kv_head = rank * num_heads // tp // (num_heads // num_kv_heads)  # the KV head its query heads read
        assert q.tolist() == list(range(rank * 2 * head_dim, (rank + 1) * 2 * head_dim))
        assert k.tolist() == [100 + kv_head * head_dim + d for d in range(head_dim)]
        assert v.tolist() == [200 + kv_head * head_dim + d for d in range(head_dim)]
    with pytest.raises(ValueError, match="num_key_value_heads=2 neither divides by tensor_parallel_size=3"):
        ranks_of(monkeypatch, 3, hidden_size=3, head_dim=2, num_heads=6, num_kv_heads=2)


def test_one_kv_head_at_tp2_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM
    path = make_random_checkpoint(tmp_path / "mqa", "tiny", num_key_value_heads=1)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with LLM(str(path), kvcache_block_size=16, tensor_parallel_size=2) as llm:
        assert llm.model_runner.attn_layers[0].num_kv_heads == 1
        greedy = generate_twice(llm)
    for prompt, out in zip(PROMPTS, greedy):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])


def test_message_buffer_grows(tiny_model, monkeypatch):
    monkeypatch.setattr(tp_channel, "SHM_SIZE", 256)
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.model_runner.channel.shm.size > 256
        assert len(shm_segments()) == 1  # the outgrown buffers are gone
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == \
            [o["token_ids"] for o in out]
    assert shm_segments() == []


def _slow_worker(name: str, semaphores, queue):
    import random
    tp_channel.dist.barrier = lambda: None  # one channel, no process group
    channel, received = tp_channel.Channel(name, 1, semaphores), []
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
    """Rank 0's end of a channel, alone (no process group), and a process running `worker_fn(name, semaphores,
    *args)` at the other end."""
    monkeypatch.setattr(tp_channel.dist, "barrier", lambda: None)
    ctx = mp.get_context("spawn")
    semaphores, name = tp_channel.channel_semaphores(ctx), f"nanovllm-{os.getpid()}-test"
    channel = tp_channel.Channel(name, 0, [semaphores])
    worker = ctx.Process(target=worker_fn, args=(name, [semaphores], *args))
    worker.start()
    return channel, worker


def calls_reach_the_worker(channel: tp_channel.Channel, worker: mp.Process, queue, sent: list):
    """Rank 0 posts `sent` and "exit"; the worker must have received `sent`. Fails, not hangs, when a worker that
    died leaves a post waiting for good, and kills a worker still waiting after a failure (pytest's exit would
    wait for it)."""
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
    # with overlap scheduling rank 0 posts step N+1 while a worker may still be launching step N, and NCCL does
    # not make rank 0 wait for the worker: the channel must not write over a call nobody has taken
    queue = mp.get_context("spawn").Queue()
    channel, worker = channel_to(_slow_worker, queue, monkeypatch=monkeypatch)
    calls_reach_the_worker(channel, worker, queue, [[i, list(range(i % 50))] for i in range(300)])


def test_calls_of_every_size_reach_the_worker(monkeypatch):
    """A call of any length gets through, the buffer growing as needed: those within a header of the buffer's
    size, and one more than twice its size at once."""
    monkeypatch.setattr(tp_channel, "SHM_SIZE", 256)
    queue = mp.get_context("spawn").Queue()
    channel, worker = channel_to(_slow_worker, queue, monkeypatch=monkeypatch)
    sizes = [*range(600), 5000]  # past 256 and 512 a byte at a time, then past twice the buffer at once
    calls_reach_the_worker(channel, worker, queue, [[b"x" * n] for n in sizes])


def _waiting_worker(name: str, semaphores, took_one):
    tp_channel.dist.barrier = lambda: None
    channel = tp_channel.Channel(name, 1, semaphores)
    channel.receive()
    took_one.set()
    channel.receive()  # asleep here when it is killed


def test_a_post_to_a_worker_killed_while_it_waits_does_not_block(monkeypatch):
    # (a multiprocessing Event's set() waits for every sleeper in wait() to wake: forever for a killed one)
    took_one = mp.get_context("spawn").Event()
    channel, worker = channel_to(_waiting_worker, took_one, monkeypatch=monkeypatch)
    channel.post("run", 1)
    assert took_one.wait(60)
    time.sleep(0.5)  # asleep, waiting for the next call
    worker.kill()
    worker.join(10)
    within(5, channel.post, "run", 2)  # the buffer was taken: this post goes through
    channel.abort()  # what the engine's watch does when it sees the worker gone: the next post raises
    with pytest.raises(RuntimeError, match="worker is gone"):
        within(5, channel.post, "run", 3)
    channel.close()


def fails_where_unpickled():
    raise RuntimeError("out of memory on the worker")


class FailsOnTheWorker:
    """An argument of a call that raises when the worker reads it: an exception of the worker's own."""

    def __reduce__(self):
        return fails_where_unpickled, ()


def test_a_workers_own_exception_is_named_in_the_error(tiny_model):
    # an exception that ends a worker is named in the error that calls then raise, beside its exit code (the
    # process itself may end in an abort after it); before, only the exit code was
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
    llm.model_runner.channel.post("run", FailsOnTheWorker())
    within(30, llm.processes[0].join)
    for _ in range(2):  # the first call and a later one
        with pytest.raises(RuntimeError, match="worker rank 1 .* died with exit code -?[0-9]+ after RuntimeError: "
                                               "out of memory on the worker; close this engine"):
            within(30, llm.generate, PROMPTS[:1], GREEDY, use_tqdm=False)
    within(30, llm.close)
    assert shm_segments() == []


def test_a_workers_own_exception_is_in_its_stderr_and_exit_code(tiny_model, capfd):
    # the worker tells rank 0 and still fails as before: a nonzero exit, its traceback on its stderr
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
    llm.model_runner.channel.post("run", FailsOnTheWorker())
    within(30, llm.processes[0].join)
    assert llm.processes[0].exitcode != 0
    within(30, llm.close)
    err = capfd.readouterr().err
    assert "Traceback" in err and "RuntimeError: out of memory on the worker" in err


def test_worker_error_is_kept_for_later_calls_and_a_closed_pipe_is_none():
    # what a worker said is read once and kept (later errors name it too); a pipe closed or broken says nothing
    reader, writer = mp.Pipe(duplex=False)
    process = SimpleNamespace(errors=reader, error=None, exitcode=1, pid=123)
    assert worker_error(process) is None  # nothing said yet
    writer.send("RuntimeError: boom")
    assert worker_error(process) == worker_error(process) == "RuntimeError: boom"
    assert "died with exit code 1 after RuntimeError: boom;" in str(worker_died(1, process))
    closed_reader, closed_writer = mp.Pipe(duplex=False)
    closed_writer.close()  # a worker that ended without a word
    assert worker_error(SimpleNamespace(errors=closed_reader, error=None)) is None
    closed_reader.close()
    assert worker_error(SimpleNamespace(errors=closed_reader, error=None)) is None


def test_killed_worker_is_an_error_not_a_hang(tiny_model):
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    worker = llm.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 .* died"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5
    llm.close()
    assert shm_segments() == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_a_worker_that_dies_while_starting_is_an_error_not_a_hang(tiny_model):
    before = set(mp.active_children())

    def kill_the_new_worker():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            new = [p for p in mp.active_children() if p not in before]
            if new:
                os.kill(new[0].pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    threading.Thread(target=kill_the_new_worker, daemon=True).start()
    with pytest.raises(RuntimeError, match="worker rank 1 .* died with exit code -9"):
        within(30, LLM, tiny_model, tensor_parallel_size=2)
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2) as llm:  # and the next engine starts
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)
    assert shm_segments() == []


def test_a_worker_that_dies_while_rank_0_warms_up_is_named(tiny_model, monkeypatch):
    # after the rendezvous, rank 0 loads or waits in a collective (with NCCL it would wait there for good; the
    # engine's start-up watch aborts the collectives). The error names the worker, and the process can start
    # another engine: the failed one's process group is gone
    kill_the_worker_as_rank_0_sizes_its_cache(monkeypatch)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 .* died with exit code -9"):
        LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
    assert time.monotonic() - started < 60
    monkeypatch.undo()
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)


def test_a_worker_that_crashes_in_native_code_says_where(tiny_model, capfd):
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        os.kill(llm.processes[0].pid, signal.SIGSEGV)  # as a crash in a kernel library would
        llm.processes[0].join(10)  # (beside the engine's own watch, which reaps it too)
        with pytest.raises(RuntimeError, match="worker rank 1 .* died with exit code -11"):
            within(5, llm.generate, PROMPTS, GREEDY, use_tqdm=False)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "model_runner.py" in err  # the worker's stack


def test_second_tp_engine_in_one_process_is_refused(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2):
        with pytest.raises(RuntimeError, match="another engine"):
            LLM(tiny_model, tensor_parallel_size=2)
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2) as llm:  # fine once the first is closed
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)


def test_a_new_tp_engine_waits_for_an_earlier_ones_collectives_abort(tiny_model, monkeypatch):
    """NCCL's abort after a dead worker may take long (over 30 s on two H200s) and then tears the process group
    down under any engine started meanwhile: a new engine waits for it, and past ABORT_WAIT says what to do."""
    from nanovllm.engine import workers
    monkeypatch.setattr(workers, "ABORT_WAIT", 1.0)
    with workers.COLLECTIVES_ABORT:  # an abort that does not end
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="NCCL has not torn its process group down after 1 s; start a new "
                                               "process"):
            LLM(tiny_model, tensor_parallel_size=2)
        assert time.monotonic() - started < 10
    threading.Timer(0.5, workers.COLLECTIVES_ABORT.release).start()
    workers.COLLECTIVES_ABORT.acquire()  # an abort that ends half a second from now: the engine starts after it
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        assert not workers.COLLECTIVES_ABORT.locked()
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)


def test_an_error_on_rank_0_mid_step_ends_the_engine_without_a_hang(tiny_model):
    # rank 0 raises in its forward while the worker runs the same step: the worker waits for good in a collective
    # that rank 0 never reaches. The requests fail with the error, later calls say why the engine cannot go on
    # (instead of running collectives out of step with the worker), and close() does not wait for the worker
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    embed = llm.model_runner.model.model.embed_tokens

    def fails(*args):
        raise ValueError("injected on rank 0")

    embed.forward = fails
    with pytest.raises(ValueError, match="injected on rank 0"):
        within(30, llm.generate, PROMPTS, GREEDY, use_tqdm=False)
    del embed.forward
    with pytest.raises(RuntimeError, match="rank 0 failed in a step .*ValueError.*injected on rank 0.*close this "
                                           "engine"):
        within(30, llm.generate, PROMPTS, GREEDY, use_tqdm=False)
    start = time.monotonic()
    within(30, llm.close)
    assert time.monotonic() - start < 15
    assert shm_segments() == [] and not llm.processes[0].is_alive()


def step_held_on_rank_0(llm: LLM) -> tuple[threading.Thread, dict, threading.Event]:
    """A caller's step() of a new request on another thread (`in_background`), held inside rank 0's forward (its
    workers in the step's first collective) until the event it returns is set."""
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
    # close() from one thread while another is inside its own step() (add_request + step loops): close waits for
    # that step to end before it tears down, and the caller's next step() says the engine is closed. Before, close
    # went ahead: at TP=2 its exit barrier and the step's collectives waited for each other for good, at TP=1 it
    # freed the cache under the step, which failed with a shape error. A second close() meanwhile returns only
    # once the first has torn everything down (before, at once)
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=tp)
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
    assert closed["value"] == closed_again["value"] == ([], [False] * (tp - 1), None)  # all gone when each returned
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.step()
    assert shm_segments() == [] and not any(process.is_alive() for process in llm.processes)


def test_an_interrupt_while_close_waits_for_a_step_kills_the_workers_without_an_exit(tiny_model, monkeypatch):
    # a ^C while close() waits for a caller's step in progress: the workers are killed, not told to exit (the
    # exit's barrier and the step's collectives would wait for each other), and close() returns at once
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
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


def test_an_error_on_rank_0_between_steps_leaves_a_tp_engine_usable(tiny_model):
    # an error on the host after a step's collectives (here in its bookkeeping) leaves the worker in step: the
    # engine serves the next requests, as it does at TP=1
    with LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        complete = llm.scheduler.complete

        def fails(*args):
            raise ValueError("injected after the step")

        llm.scheduler.complete = fails
        with pytest.raises(ValueError, match="injected after the step"):
            within(30, llm.generate, PROMPTS, GREEDY, use_tqdm=False)
        llm.scheduler.complete = complete
        assert [o["token_ids"] for o in within(30, llm.generate, PROMPTS, GREEDY, use_tqdm=False)] == expected


def _engine_in_a_process(model: str, queue):
    with LLM(model, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        token_ids = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    queue.put((token_ids, shm_segments()))


def test_two_engines_at_once_on_one_host(tiny_model):
    results = in_processes(_engine_in_a_process, tiny_model)
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert results == [(expected, [])] * 2  # and neither left shared memory behind


def test_worker_killed_mid_generate_fails_it_within_5s(tiny_model, monkeypatch):
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    thread, outcome, killed = kill_worker_while_decoding(llm, PROMPTS, long)
    thread.join(5)
    assert not thread.is_alive(), "generate still blocked 5 s after the worker died"
    assert time.monotonic() - killed < 5 and isinstance(outcome.get("error"), RuntimeError)
    # a killed worker's socket closes before the process is reaped: close() may still see it alive
    monkeypatch.setattr(llm.processes[0], "is_alive", lambda: True)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 15
    assert shm_segments() == []


def test_a_step_stuck_in_a_collective_is_freed_when_a_worker_dies(tiny_model):
    # NCCL's collectives do not fail when a peer dies (gloo's do): rank 0's step waits forever. Here the step
    # waits on an Event that only the engine's watch over its workers can set, as it aborts NCCL's collectives.
    llm = LLM(tiny_model, kvcache_block_size=16, tensor_parallel_size=2)
    collectives_aborted, in_step, failed_first = threading.Event(), threading.Event(), []
    # the watch fails the requests before it frees the step: a freed collective's results are garbage
    llm.model_runner.abort_collectives = lambda: (failed_first.append(llm._loop.error), collectives_aborted.set())
    run = llm.model_runner.run

    def stuck_run(seqs):
        if len(seqs[0]) > len(PROMPTS[0]) + 5:  # decoding for a while: stick
            in_step.set()
            collectives_aborted.wait()
        return run(seqs)

    llm.model_runner.run = stuck_run
    thread, outcome = in_background(llm.generate, PROMPTS[:1],
                                    SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert in_step.wait(60)
    os.kill(llm.processes[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(5)
    assert not thread.is_alive(), "generate still blocked 5 s after the worker died"
    assert time.monotonic() - killed < 5 and collectives_aborted.is_set()
    assert len(failed_first) == 1 and "worker rank 1" in str(failed_first[0])
    assert "worker rank 1" in str(outcome.get("error")) and "died" in str(outcome["error"])
    with pytest.raises(RuntimeError, match="worker rank 1 .* died"):
        llm.submit(PROMPTS[0])
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 15
    assert shm_segments() == []
