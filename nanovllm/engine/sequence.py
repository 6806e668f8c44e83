"""One request: its tokens, how many of them are in the KV cache, and its block table.

With overlap scheduling a sequence's last token may be pending: sampled by the step in flight, its value is
still on the GPU (row `pending_row` of that step's sampled tokens), and its place holds PENDING until the
step completes. The next step can already compute it: the model runner reads the value there.
"""
from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

PENDING = -1  # the place of a token that the step in flight sampled and the host does not know yet


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    __slots__ = (
        "seq_id", "status", "token_ids", "last_token", "num_tokens", "num_prompt_tokens",
        "num_computed_tokens", "num_cached_tokens", "num_scheduled_tokens", "block_table", "block_hashes",
        "params", "plain_sampling", "finish_reason", "stop_reason", "logprobs", "pending_row",
    )
    counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams = SamplingParams()):
        self.seq_id = next(Sequence.counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache at first admission
        self.num_scheduled_tokens = 0  # tokens this step computes
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of its first full blocks (the block manager's)
        self.params = sampling_params
        self.plain_sampling = sampling_params.is_plain  # read every step: cached
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.pending_row = -1  # >= 0: the last token is PENDING, in this row of the step in flight's samples

    def __len__(self):
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def scheduled_token_ids(self) -> list[int]:
        return self.token_ids[self.num_computed_tokens:self.num_computed_tokens + self.num_scheduled_tokens]

    @property
    def samples_this_step(self) -> bool:
        """A step samples a token for this sequence when it computes up to the last token."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    def num_blocks(self, block_size: int) -> int:
        return (self.num_tokens + block_size - 1) // block_size

    def block(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    @property
    def is_pending(self) -> bool:
        return self.pending_row >= 0

    def append_pending(self, row: int):
        """A step was launched that samples this sequence's next token into `row` of its samples."""
        self.token_ids.append(PENDING)
        self.last_token = PENDING
        self.num_tokens += 1
        self.pending_row = row

    def fill_pending(self, token_id: int, logprobs: dict[int, float] | None = None):
        """The step completed: the pending last token is `token_id`."""
        assert self.is_pending
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        self.token_ids[-1] = self.last_token = token_id
        self.pending_row = -1

    def drop_pending(self):
        """The sequence ends before its pending token arrives (an abort): that token is not part of it."""
        if self.is_pending:
            self.token_ids.pop()
            self.num_tokens -= 1
            self.last_token = self.token_ids[-1]
            self.pending_row = -1

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None):
        self.append_pending(0)
        self.fill_pending(token_id, logprobs)
