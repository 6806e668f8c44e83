"""Tensor parallelism over NCCL: TP=n matches at bf16 tolerance with CUDA graphs on every rank, a killed worker
fails waiting calls within seconds and `close()` returns, two engines run in two processes, /dev/shm ends empty."""
import time

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.conftest import (OnCuda, assert_greedy_matches_hf, in_processes, kill_the_worker_as_rank_0_sizes_its_cache,
                            kill_worker_while_decoding, shm_segments, within)
from tests.conftest import greedy
from tests.test_gpu_engine import prompts

pytestmark = pytest.mark.gpu
TP_SIZES = [pytest.param(tp, marks=pytest.mark.skipif(torch.cuda.device_count() < tp, reason=f"needs {tp} GPUs"))
            for tp in (2, 4, 8)]
ENGINE = dict(max_model_len=1024, max_num_seqs=16)  # few graphs to capture: quick to start


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory) -> str:
    """Qwen3-0.6B's widths (8 KV heads: any TP size up to 8) with 4 layers."""
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    return str(make_random_checkpoint(tmp_path_factory.mktemp("qwen3-4l"), "qwen3-0.6b", num_hidden_layers=4))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tp_equals_tp1_with_graphs_on_every_rank(qwen3_small, tp):
    from transformers import AutoModelForCausalLM
    batch = prompts(16, seed=7, lo=20, hi=300)
    with LLM(qwen3_small, **ENGINE) as llm:
        expected = [o["token_ids"] for o in llm.generate(batch, greedy(32), use_tqdm=False)]
    llm = LLM(qwen3_small, tensor_parallel_size=tp, **ENGINE)
    ranks = llm.model_runner.call("describe")
    got = [o["token_ids"] for o in llm.generate(batch, greedy(32), use_tqdm=False)]
    within(60, llm.close)  # (destroying NCCL's communicator while graphs that captured it live hangs)
    assert [r["device"] for r in ranks] == [f"cuda:{rank}" for rank in range(tp)]
    assert all(r["graphs"] == [1, 2, 4, 8, 16] for r in ranks), ranks
    # another reduction order may part from TP=1 at a near tie: each token is HF's argmax within bf16 tolerance
    hf = OnCuda(AutoModelForCausalLM.from_pretrained(qwen3_small, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").cuda())
    for prompt, out in zip(batch, got):
        assert_greedy_matches_hf(hf, prompt, out, atol=0.15)
    # (how many sequences part from TP=1 is not a check: a random 4-layer model has many near ties)
    print(f"TP={tp}: {sum(g == e for g, e in zip(got, expected))} of {len(batch)} sequences equal TP=1's token "
          f"for token")
    assert shm_segments() == []


@pytest.mark.parametrize("tp", TP_SIZES)
def test_fewer_kv_heads_than_ranks_match_hf(tmp_path, tp):
    """Two KV heads on tp ranks: each KV head replicated on tp / 2 of them."""
    from transformers import AutoModelForCausalLM
    from nanovllm.utils.random_checkpoint import make_random_checkpoint
    path = str(make_random_checkpoint(tmp_path / "kv2", "qwen3-0.6b", num_hidden_layers=4, num_key_value_heads=2))
    batch = prompts(8, seed=9, lo=20, hi=300)
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
    assert llm.model_runner.attn_layers[0].num_kv_heads == 1
    got = [o["token_ids"] for o in llm.generate(batch, greedy(24), use_tqdm=False)]
    within(60, llm.close)
    hf = OnCuda(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda())
    for prompt, out in zip(batch, got):
        assert_greedy_matches_hf(hf, prompt, out, atol=0.15)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_killed_worker_fails_waiting_calls_within_seconds(qwen3_small, tp):
    """Rank 0 may wait in a collective (in a graph) for the dead peer: the watch fails the calls and aborts the
    collectives, `close()` frees the GPU. An abort that never returns keeps the process group: a new TP engine
    waits for it or says to use a new process; a TP=1 engine runs here."""
    batch = prompts(8, seed=8, lo=20, hi=100)
    llm = LLM(qwen3_small, tensor_parallel_size=tp, **ENGINE)
    expected = [o["token_ids"] for o in llm.generate(batch, greedy(16), use_tqdm=False)]
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    thread, outcome, killed = kill_worker_while_decoding(llm, batch, long, settle=0.3)  # decoding in CUDA graphs
    thread.join(10)
    assert not thread.is_alive(), "generate still blocked 10 s after a worker died"
    print(f"TP={tp}: generate raised {time.monotonic() - killed:.2f} s after the kill")
    assert time.monotonic() - killed < 5
    assert isinstance(outcome.get("error"), RuntimeError) and f"worker rank {tp - 1}" in str(outcome["error"])
    with pytest.raises(RuntimeError, match=f"worker rank {tp - 1} .* died"):
        llm.generate(batch, greedy(4), use_tqdm=False)
    within(30, llm.close)  # a step may still wait in a collective on the device: close must not wait for it
    assert not any(p.is_alive() for p in llm.processes)
    assert shm_segments() == []
    free, total = torch.cuda.mem_get_info(0)
    assert free > 0.8 * total, f"close() left {(total - free) / 2**30:.1f} GiB of GPU 0 in use"
    try:  # waits for NCCL's abort (up to ABORT_WAIT s)
        again = LLM(qwen3_small, tensor_parallel_size=tp, **ENGINE)
    except RuntimeError as e:
        assert "start a new process" in str(e)
        print(f"TP={tp}: no new TP engine in this process: {e}")
    else:
        with again:
            assert [o["token_ids"] for o in again.generate(batch, greedy(16), use_tqdm=False)] == expected
        print(f"TP={tp}: a new TP engine ran {time.monotonic() - killed:.0f} s after the kill")
    with LLM(qwen3_small, **ENGINE) as single:  # the GPU itself serves on
        assert all(len(o["token_ids"]) == 16 for o in single.generate(batch, greedy(16), use_tqdm=False))


def test_a_worker_that_dies_while_rank_0_starts_is_named(qwen3_small, monkeypatch):
    """Rank 0 would wait for good in the collective after sizing its cache; the start-up watch aborts it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    kill_the_worker_as_rank_0_sizes_its_cache(monkeypatch)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 .* died"):
        within(90, LLM, qwen3_small, tensor_parallel_size=2, **ENGINE)
    print(f"TP=2: a worker dead while rank 0 started: raised after {time.monotonic() - started:.1f} s")
    monkeypatch.undo()
    with LLM(qwen3_small, **ENGINE) as single:  # the GPU serves on
        assert len(single.generate(prompts(2, seed=3), greedy(4), use_tqdm=False)) == 2


def _engine_in_a_process(model: str, tp: int, queue):
    with LLM(model, tensor_parallel_size=tp, gpu_memory_utilization=0.4, **ENGINE) as llm:
        token_ids = [o["token_ids"] for o in llm.generate(prompts(8, seed=9), greedy(16), use_tqdm=False)]
    queue.put((token_ids, shm_segments()))


def test_two_tp_engines_at_once_in_separate_processes(qwen3_small):
    tp = 2
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    results = in_processes(_engine_in_a_process, qwen3_small, tp)
    assert results[0] == results[1] and results[0][1] == []  # equal tokens, and no shared memory left behind
