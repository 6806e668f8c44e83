"""The steps an engine on CUDA runs before it serves: a prefill of the largest batch before the KV cache is sized
(`sizing_prefill`: its peak activation memory is what the cache must leave free), then a step of each kind that
the scheduler makes (`kernel_warmup_steps`), so that kernels compiled on first use compile at start rather than
mid-serving. The kernel warm-up's sequences write and read the cache's first blocks; serving stores every position
of a block before it reads it, so what they leave there is never read."""
from collections.abc import Iterator

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence


def sizing_prefill(config: Config) -> list[Sequence]:
    """As many whole contexts as one step's token budget holds (at least one, cut to the budget)."""
    max_tokens, max_len = config.max_num_batched_tokens, config.max_model_len
    num_seqs = min(max_tokens // max_len, config.max_num_seqs) or 1
    seqs = [Sequence([0] * min(max_len, max_tokens)) for _ in range(num_seqs)]
    for seq in seqs:
        seq.num_scheduled_tokens = seq.num_tokens
    return seqs


def kernel_warmup_steps(config: Config, block_size: int) -> Iterator[list[Sequence]]:
    """Each kind of step the scheduler makes, at the shapes that pick a kernel variant (flash-attn-4 compiles one
    per variant; torch.compile; the Triton kernels), made one at a time. Twice: small steps (which the Triton
    varlen kernel takes where flash-attn-4 would cost more host time than device time) and steps of half the token
    budget (flash-attn-4's). Each time: a decode beside a prefill chunk after a cached prefix; a decode beside a
    2-token chunk (flash-attn-4 runs steps whose longest chunk fits one tile of query rows with a kernel of its
    own); the widest steps, of max_num_seqs sequences (over 256, flash-attn-4 adds a lookup to its scheduler),
    with many decodes and one chunk (a mixed step that splits off its decodes; the first time also with fewer
    decodes) and with short chunks only; a prefix prefill alone; then a decode-only step. No position reaches
    max_model_len (at most the cache's tokens and the model's max_position_embeddings, where its rope table ends):
    where half the budget is more than half a context, its chunks are those of several sequences."""
    max_len, num_seqs = config.max_model_len, config.max_num_seqs

    def seq(num_computed: int, length: int) -> Sequence:
        seq = Sequence([0] * length)
        seq.block_table = list(range(-(-length // block_size)))  # the cache holds nothing yet
        seq.num_computed_tokens, seq.num_scheduled_tokens = num_computed, length - num_computed
        return seq

    def chunks(tokens: int, length: int) -> list[Sequence]:
        """Chunks of `tokens` in all, each the second half of a context, as many as fit beside a decode."""
        half = max(length // 2, 1)
        return [seq(length - half, length) for _ in range(min(-(-tokens // half), max(num_seqs - 1, 1)))]
    budget = config.max_num_batched_tokens
    for i, (length, tokens) in enumerate(sorted({(min(2 * block_size, max_len), max(min(block_size, max_len // 2), 1)),
                                                 (min(budget, max_len), max(budget // 2, 1))})):
        chunk = min(max(2, tokens // num_seqs), length)
        yield [seq(length - 1, length), *chunks(tokens, length)]
        yield [seq(length - 1, length), seq(max(length - 2, 0), length)]
        prefills = chunks(tokens, length)
        most = num_seqs - len(prefills)  # first also every power of two fewer decodes: a decode kernel may
        # pick its variant by the batch's programs an SM (`triton_attention.decode_tile`: ranges of a factor
        # of 2 or more, each of which holds a power of two)
        for decodes in sorted({most, *(1 << k for k in range(most.bit_length()) if 1 << k < most)}) \
                if i == 0 else [most]:
            yield [seq(length - 1, length) for _ in range(decodes)] + prefills
        yield [seq(length - chunk, length) for _ in range(num_seqs)]
        yield chunks(tokens, length)
    yield [seq(length - 1, length)]  # a decode-only step: backends may have a kernel of its own
