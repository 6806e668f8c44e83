import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from queue import Empty

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter runs the kernels on CPU; it must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.utils.random_checkpoint import make_random_checkpoint  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# a background job inherits SIGINT ignored; the tests of ^C need Python's handler, as a terminal's run has it
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_ray_stop = []  # how to stop the session's Ray cluster, while it runs


@pytest.fixture(scope="session")
def ray_cluster():
    """A local 2-CPU Ray cluster for the session, stopped after the last test using it: idle, it takes CPU."""
    import ray
    # Ray's worker processes must import this checkout
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved]))

    def stop():
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved

    _ray_stop.append(stop)
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, logging_level=logging.WARNING)  # the same anywhere
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield
    finally:
        while _ray_stop:
            _ray_stop.pop()()


def pytest_runtest_teardown(item, nextitem):
    if _ray_stop and "ray_cluster" in item.fixturenames:
        later = item.session.items[item.session.items.index(item) + 1:]
        if not any("ray_cluster" in getattr(i, "fixturenames", ()) for i in later):
            _ray_stop.pop()()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny"))


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


class OnCuda:
    """An HF model on CUDA as assert_greedy_matches_hf calls it: CPU ids in, CPU float32 logits out."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids):
        with torch.no_grad():
            out = self.model(ids.cuda())
        out.logits = out.logits.float().cpu()
        return out


def free_order(bm) -> list[int]:
    """A BlockManager's free blocks in the order it hands them out: the fresh (not yet made) by id, then the freed."""
    return [*range(len(bm.blocks), bm.num_blocks), *bm.free_block_ids]


def every_block(bm) -> list:
    """Every block of a BlockManager's cache, a fresh one as it will be made."""
    from nanovllm.engine.block_manager import Block
    return bm.blocks + [Block(i) for i in range(len(bm.blocks), bm.num_blocks)]


def assert_greedy_matches_hf(hf_model, prompt_ids: list[int], output_ids: list[int], atol: float = 1e-4):
    """Teacher-forced check: each generated token is HF's argmax (within `atol`) given everything before it."""
    assert output_ids, "no tokens were generated"
    full = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf_model(full).logits[0, len(prompt_ids) - 1:-1].float()
    picked = logits.gather(1, torch.tensor(output_ids)[:, None])[:, 0]
    gap = logits.max(dim=1).values - picked
    assert gap.max().item() <= atol, f"token {gap.argmax().item()} is {gap.max().item():.2e} below HF's argmax"


def built_on_ranks(monkeypatch, module, tp: int, make) -> list:
    """make() as each of `tp` ranks builds it (`module`'s tp_rank and tp_size patched)."""
    layers = []
    for rank in range(tp):
        monkeypatch.setattr(module, "tp_rank", lambda: rank)
        monkeypatch.setattr(module, "tp_size", lambda: tp)
        layers.append(make())
    return layers


def wait_until(condition, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def assert_idle_and_clean(llm, seconds: float = 30):
    wait_until(llm.is_finished, seconds)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """fn(*args, **kwargs) started on a daemon thread; the dict gets its "value" or its "error" when it ends."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def raising(error: BaseException):
    def fn(*args, **kwargs):
        raise error
    return fn


def refuses(error: type, match: str, model, /, **engine_args):
    with pytest.raises(error, match=match):
        LLM(str(model), **engine_args)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def within(seconds: float, fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread: its result or exception, or a failure if still blocked after `seconds`."""
    thread, outcome = in_background(fn, *args, **kwargs)
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still blocked after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def full_rebuild_penalties(logits: torch.Tensor, histories: list[tuple[list[int], list[int]]], params: list
                           ) -> torch.Tensor:
    """The penalties from masks rebuilt from each row's (prompt, output): the engine's state must match bit for bit."""
    seen = torch.zeros(logits.shape, dtype=torch.bool)
    counts = torch.zeros(logits.shape)
    for row, (prompt, output) in enumerate(histories):
        seen[row, prompt + output] = True
        for t in output:
            counts[row, t] += 1

    def column(name):
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32).unsqueeze(1)

    penalty = column("repetition_penalty")
    logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return logits - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)


def kill_worker_while_decoding(llm, prompts, params, settle: float = 0.2) -> tuple[threading.Thread, dict, float]:
    """generate() in the background, the last worker killed `settle` s after all run: thread, outcome, kill time."""
    thread, outcome = in_background(llm.generate, prompts, params, use_tqdm=False)
    deadline = time.monotonic() + 60
    while llm.stats()["num_running"] < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(settle)
    os.kill(llm.processes[-1].pid, signal.SIGKILL)
    return thread, outcome, time.monotonic()


def kill_the_worker_as_rank_0_sizes_its_cache(monkeypatch):
    """The next engine's one worker dies after the rendezvous, as rank 0 sizes its KV cache (run by rank 0 only)."""
    from nanovllm.engine.model_runner import ModelRunner
    allocate, before = ModelRunner.allocate_kv_cache, set(multiprocessing.active_children())

    def worker_dies_first(runner):
        (worker,) = set(multiprocessing.active_children()) - before
        worker.kill()
        worker.join(10)
        return allocate(runner)
    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", worker_dies_first)


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"nanovllm-{os.getpid()}-")}


STALE_SEGMENTS = _segments()  # a killed process's, under this pid again (pid_max may be 32,768): not ours


def shm_segments() -> list[str]:
    """The shared-memory segments that this process's engines made and did not remove."""
    return sorted(_segments() - STALE_SEGMENTS)


def in_processes(target, *args, copies: int = 2) -> list:
    """`target(*args, queue)` in `copies` spawned processes at once: what each put on its queue; each exits 0."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, queue)) for _ in range(copies)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + 300
    while len(results) < copies:
        try:
            results.append(queue.get(timeout=1))
        except Empty:  # a process that failed says so now, not when the wait runs out
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a process exited with code {failed[0]} (its error is above)"
            assert time.monotonic() < deadline, "no result after 300 s"
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


_SM90_COMPILE = """
import importlib, os, pickle, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
replies = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # whatever the compiler prints goes to stderr, not into the replies
while True:  # a list of cases in, the errors of those that fail out, until stdin closes
    try:
        cases = pickle.load(sys.stdin.buffer)
    except EOFError:
        break
    errors = []
    for module, kernel, signature, constexprs, *options in cases:
        try:
            fn = getattr(importlib.import_module(module), kernel)
            if unmatched := set(fn.arg_names).symmetric_difference([*signature, *constexprs]):
                raise TypeError(f"arguments of the kernel or the case, not of both: {sorted(unmatched)}")
            source = ASTSource(fn, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs)
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(*options))
        except Exception as e:
            errors.append("\\n".join([f"{kernel} {constexprs} does not compile for sm90:", *str(e).splitlines()[-8:]]))
    pickle.dump(errors, replies)
    replies.flush()
"""
_sm90_compiler = None  # the subprocess that compiles, started by the first call and kept for the session


def compile_for_sm90(cases: list[tuple]):
    """Compile Triton kernels for sm90 to cubins with no GPU, in one subprocess kept for the session (starting it
    costs more than a compile): the interpreter of the CPU tests never type-checks as the compiler does.

    A case is (module, kernel, signature, constexprs), optionally followed by its wrapper's launch options
    (num_warps, num_stages). The signature types each runtime argument as a launch specializes it: "*bf16", "i32"
    for an int in int32's range ("i64" beyond), "fp32"; an int equal to 1 becomes a constexpr, so it goes in
    constexprs (values may be Triton dtypes: cases are pickled). Fails with the error of each case that fails."""
    import atexit
    import pickle
    import select
    import subprocess
    import sys
    global _sm90_compiler
    if _sm90_compiler is None or _sm90_compiler.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        _sm90_compiler = subprocess.Popen([sys.executable, "-W", "ignore", "-c", _SM90_COMPILE], env=env, cwd=ROOT,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        atexit.register(_sm90_compiler.kill)
    compiler = _sm90_compiler
    compiler.stdin.write(pickle.dumps(cases))
    compiler.stdin.flush()
    if not select.select([compiler.stdout], [], [], 300)[0]:
        compiler.kill()
        pytest.fail("the sm90 compiles took over 300 s", pytrace=False)
    try:
        errors = pickle.load(compiler.stdout)
    except EOFError:
        pytest.fail(f"the compiling subprocess exited with code {compiler.wait()} (its error is above)", pytrace=False)
    if errors:
        pytest.fail("\n\n".join(errors), pytrace=False)
