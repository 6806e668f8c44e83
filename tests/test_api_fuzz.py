"""The public API under random interleavings (submits read fast, slowly or abandoned, aborts, generate from two
threads) and random block sizes, budgets and preempting caches: every call ends in time, every handle finishes
once, the cache is whole when idle, and greedy or seeded outputs equal the request run alone (up to float32 ties)."""
import threading
import time

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sampling_batch import draw_seed
from nanovllm.utils.random_checkpoint import default_checkpoint
from tests.conftest import in_background

TIMEOUT = 60  # seconds any one call may take on a slow CI machine
PROMPTS = st.lists(st.integers(3, 500), min_size=1, max_size=40)
PARAMS = st.builds(
    lambda seed, max_tokens, ignore_eos: SamplingParams(
        temperature=0 if seed is None else 0.9, seed=seed, max_tokens=max_tokens, ignore_eos=ignore_eos),
    st.none() | st.integers(0, 1000), st.integers(1, 24), st.booleans())


class Request:
    """A submitted request, what its consumer saw, and how it is read."""

    def __init__(self, prompt, params, handle, mode):
        self.prompt, self.params, self.handle, self.mode = prompt, params, handle, mode
        self.increments: list[dict] = []
        self.aborted = False
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for increment in self.handle:
            self.increments.append(increment)
            if self.mode == "slow":
                time.sleep(0.005)
            if self.mode == "abandoned":
                return


class ApiMachine(RuleBasedStateMachine):

    @initialize(block_size=st.sampled_from([16, 32]), num_blocks=st.integers(3, 8),
                budget=st.integers(16, 128), prefill_first=st.booleans())
    def build(self, block_size, num_blocks, budget, prefill_first):
        self.llm = LLM(str(default_checkpoint("tiny")), kvcache_block_size=block_size,
                       num_kvcache_blocks=num_blocks, max_num_batched_tokens=budget, prefill_first=prefill_first)
        self.requests: list[Request] = []
        self.batches: list[tuple[list, list, list[dict]]] = []  # generate calls: prompts, params, outputs

    @rule(prompt=PROMPTS, params=PARAMS, mode=st.sampled_from(["fast", "slow", "abandoned", "result"]))
    def submit(self, prompt, params, mode):
        self.requests.append(Request(prompt, params, self.llm.submit(prompt, params), mode))

    # any request, finished or not (timing must not change hypothesis's draws); aborting a finished one is a no-op
    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from(self.requests))
        request.aborted = True
        request.handle.abort()

    @rule(first=st.lists(st.tuples(PROMPTS, PARAMS), min_size=1, max_size=4),
          second=st.lists(st.tuples(PROMPTS, PARAMS), min_size=1, max_size=4))
    def generate_from_two_threads(self, first, second):
        batches = [([p for p, _ in batch], [s for _, s in batch]) for batch in (first, second)]
        threads = [in_background(self.llm.generate, *batch) for batch in batches]
        for thread, _ in threads:
            thread.join(TIMEOUT)
            assert not thread.is_alive(), "generate did not return in time"
        for (prompts, params), (_, outcome) in zip(batches, threads):
            out = outcome.get("value")
            assert out is not None and len(out) == len(prompts), outcome.get("error")
            self.batches.append((prompts, params, out))

    @rule()
    def wait_until_idle(self):
        self._wait_idle()

    def _wait_idle(self):
        for request in self.requests:
            request.handle.result(timeout=TIMEOUT)
            request.reader.join(TIMEOUT)
            assert not request.reader.is_alive(), "a reader is still blocked on a finished handle"
        deadline = time.monotonic() + TIMEOUT
        while not self.llm.is_finished():
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.005)
        stats = self.llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]

    @invariant()
    def nothing_finished_twice(self):
        for request in getattr(self, "requests", []):
            finals = [i for i in request.increments if i["finished"]]
            assert len(finals) <= 1 and (not finals or request.increments[-1] is finals[0])

    def assert_same_tokens(self, prompt, params, got, want):
        """Equal, except that outputs may part at a float32 tie: batched or preempted, a request rounds its logits
        differently from one run alone. A tie of greedy logits, or of seeded scores logit / T - log(noise), the
        noise of the request's seed at that position (`Sampler.sample`), of the two best tokens."""
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is None:
            assert got == want, f"one output is a prefix of the other: {got} {want}"
            return
        config = self.llm.config
        vocab = config.hf_config.vocab_size
        top = self.llm.generate([list(prompt) + got[:j]], SamplingParams(temperature=0, max_tokens=1, logprobs=vocab),
                                use_tqdm=False)[0]["logprobs"][0]
        scores = torch.tensor([top[t] for t in range(vocab)])
        if params.temperature > 0:
            draw = torch.Generator(config.device).manual_seed(draw_seed(params.seed, len(prompt) + j))
            noise = torch.empty(vocab, device=config.device).exponential_(1, generator=draw)
            scores = scores / params.temperature - noise.log().cpu()
        tied = scores.max() - scores[[got[j], want[j]]]  # both tokens the best, within float32 rounding
        assert tied.max() < 1e-4, (j, got, want, tied)

    def teardown(self):
        if not hasattr(self, "llm"):
            return
        try:
            self._wait_idle()
            alone = {}

            def run_alone(prompt, params):
                key = (tuple(prompt), repr(params))
                if key not in alone:
                    alone[key] = self.llm.generate([prompt], params)[0]
                return alone[key]

            for request in self.requests:
                out = request.handle.result(timeout=0)
                again = list(request.handle)  # a second reading replays every increment
                assert [i for i in again if i["finished"]] == [again[-1]]
                if request.mode != "abandoned":
                    assert again == request.increments
                assert sum((i["token_ids"] for i in again), []) == out["token_ids"]
                reference = run_alone(request.prompt, request.params)["token_ids"]
                if out["finish_reason"] == "abort":
                    assert request.aborted
                    reference = reference[:len(out["token_ids"])]
                self.assert_same_tokens(request.prompt, request.params, out["token_ids"], reference)
            for prompts, params, outputs in self.batches:
                for prompt, p, out in zip(prompts, params, outputs):
                    self.assert_same_tokens(prompt, p, out["token_ids"], run_alone(prompt, p)["token_ids"])
        finally:
            self.llm.close()


ApiMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=12, deadline=None)
test_public_api_under_random_interleavings = ApiMachine.TestCase
