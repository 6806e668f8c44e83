"""Whole CUDA graphs for small prefills, chunks and mixed steps, where attention is Triton's varlen kernel.

Piecewise graphs (`piecewise_graphs.py`) run attention eagerly between the pieces, so such a step costs the host 28
attention launches and 29 graph launches (longer than its GPU work). Here the whole forward of a step of up to `size`
tokens and `max_seqs` sequences is one graph per token count of `graph_sizes`, replayed over static buffers that one
host-to-device copy fills, like the decode graphs'; the LM head and the sampler run after it, eagerly, on the rows
that sample. The varlen kernel's grid, which follows the step's shape, is fixed here: its programs take the rows of a
tile map instead, each a (sequence, tile of its queries) or a (decode, split of its keys), and the rows past the
step's return at once (`triton_attention.varlen_tile_map`); a second kernel merges the decodes' splits.

A step takes the smallest size >= its token count. Its padding tokens (id 0, position 0, slot -1) flow through
the rows of the linear layers, which are independent, and store nothing; no tile reads them. Padding sequences
have no tile. A step of more than `max_seqs` sequences, or one that the eager path splits (many leading decodes
beside a prompt, for the decode kernel), takes the piecewise graphs. (The decode kernel inside these graphs, on
rows padded to `max_seqs`, made steps of many prompt tokens beside a few decodes slower.)
"""
import numpy as np
import torch

from nanovllm.engine.cuda_graphs import keep_samples
from nanovllm.engine.piecewise_graphs import capture_cuda_graph, token_counts
from nanovllm.engine.staging import Staging, StaticInputs
from nanovllm.engine.step_inputs import StepInputs
from nanovllm.layers.attention import AttentionMetadata
from nanovllm.layers.triton_attention import (VARLEN_DECODE_SPLITS, VARLEN_SPLIT_TOKENS, max_varlen_tiles,
                                             splits_decodes, varlen_query_tile, varlen_tile_map)
from nanovllm.layers.triton_sampler import read_pending

MAX_SEQS = 64  # sequences in a step: each adds a row to every layer's grid, which costs even when it returns
FINE_FROM, FINE_STEP = 256, 128  # above FINE_FROM tokens, a size every FINE_STEP tokens


def graph_sizes(max_tokens: int) -> list[int]:
    """`token_counts` up to FINE_FROM, then every FINE_STEP tokens up to `max_tokens`: steps that large are bound
    by the GPU's work, which padding adds to."""
    if max_tokens <= FINE_FROM:
        return token_counts(max_tokens)
    return token_counts(FINE_FROM) + [*range(FINE_FROM + FINE_STEP, max_tokens, FINE_STEP), max_tokens]


class VarlenGraphs:

    @torch.inference_mode()
    def __init__(self, model, max_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, tokens: torch.Tensor | None = None, capture=None):
        """tokens: where the last step's samples are found on the device (the decode graphs' buffer, so that a
        step after a decode graph copies nothing), None: a buffer of its own. capture: as `PiecewiseGraphs`'."""
        self.model = model
        decoder = model.model
        attn = decoder.layers[0].self_attn.attn
        self.sizes = graph_sizes(max_tokens)
        self.max_seqs = min(MAX_SEQS, max_num_seqs)
        self.query_tile = varlen_query_tile(attn.num_heads // attn.num_kv_heads)
        self.max_model_len = max_model_len
        n, seqs = self.sizes[-1], self.seqs(self.sizes[-1])
        max_blocks = max_model_len // block_size + 1  # as the decode graphs'
        self.inputs = StaticInputs([
            ("input_ids", np.int64, (n,)), ("positions", np.int64, (n,)), ("slot_mapping", np.int64, (n,)),
            ("pending_rows", np.int64, (n,)), ("cu_seqlens_q", np.int32, (seqs + 1,)),
            ("context_lens", np.int32, (seqs,)), ("logits_indices", np.int64, (seqs,)),
            ("temperatures", np.float32, (seqs,)), ("tile_map", np.int32, (max(map(self.tiles, self.sizes)), 2)),
            ("block_tables", np.int32, (seqs, max_blocks))], device)
        v = self.inputs.vars
        v["slot_mapping"].fill_(-1)
        v["pending_rows"].fill_(-1)
        v["tile_map"].fill_(-1)
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device) if tokens is None else tokens
        self.hidden_states = torch.zeros(n, decoder.embed_tokens.weight.size(1),
                                         dtype=decoder.embed_tokens.weight.dtype, device=device)
        if capture is None:
            pool = torch.cuda.graph_pool_handle()
            capture = lambda fn: capture_cuda_graph(fn, pool)  # noqa: E731
        self.graphs = {}
        for size in reversed(self.sizes):  # the largest first: smaller ones reuse its memory
            self.graphs[size] = capture(lambda size=size: self._forward(size))

    def seqs(self, size: int) -> int:
        """The most sequences a step of `size` tokens (after padding) has."""
        return min(self.max_seqs, size)

    def tiles(self, size: int) -> int:
        return max_varlen_tiles(size, self.seqs(size), self.query_tile, self.splits(size))

    @staticmethod
    def splits(size: int) -> int:
        """The programs of each decode in a step of `size` tokens (after padding), one a split of its keys."""
        return VARLEN_DECODE_SPLITS if size <= VARLEN_SPLIT_TOKENS else 1

    def _forward(self, size: int):
        v, seqs = self.inputs.vars, self.seqs(size)
        input_ids = read_pending(self.tokens, v["pending_rows"][:size], v["input_ids"][:size])
        meta = AttentionMetadata(slot_mapping=v["slot_mapping"][:size], block_tables=v["block_tables"][:seqs],
                                 context_lens=v["context_lens"][:seqs], cu_seqlens_q=v["cu_seqlens_q"][:seqs + 1],
                                 max_seqlen_q=size, max_seqlen_k=self.max_model_len,
                                 tile_map=v["tile_map"][:self.tiles(size)], tile_map_splits=self.splits(size))
        self.hidden_states[:size] = self.model(input_ids, v["positions"][:size], meta)

    def fits(self, inputs: StepInputs) -> bool:
        return (len(inputs.input_ids) <= self.sizes[-1] and inputs.num_seqs <= self.max_seqs
                and not splits_decodes(inputs.num_leading_decodes, inputs.num_seqs))

    def run(self, inputs: StepInputs, temperatures: np.ndarray | None, last_sampled: torch.Tensor,
            staging: Staging) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Replay the step's graph: (the final hidden states of its tokens, the rows to sample on the device, the
        temperatures of a plain batch on the device), views of static buffers valid until the next run."""
        num_tokens, num_seqs, num_samples = len(inputs.input_ids), inputs.num_seqs, len(inputs.logits_indices)
        size = next(size for size in self.sizes if size >= num_tokens)
        tiles = self.tiles(size)
        host = self.inputs.host(staging)
        token_rows = np.repeat(inputs.pending_rows, inputs.query_lens)  # a pending token is its sequence's one
        for name, values, pad in (("input_ids", inputs.input_ids, 0), ("positions", inputs.positions, 0),
                                  ("slot_mapping", inputs.slot_mapping, -1), ("pending_rows", token_rows, -1)):
            host[name][:num_tokens] = values
            host[name][num_tokens:size] = pad
        host["cu_seqlens_q"][:num_seqs + 1] = inputs.cu_seqlens_q
        host["context_lens"][:num_seqs] = inputs.context_lens
        host["logits_indices"][:num_samples] = inputs.logits_indices
        if temperatures is not None:
            host["temperatures"][:num_samples] = temperatures
        host["tile_map"][:tiles] = varlen_tile_map(inputs.query_lens, self.query_tile, tiles, self.splits(size),
                                                   inputs.context_lens)
        host["block_tables"][:num_seqs, :inputs.block_tables.shape[1]] = inputs.block_tables  # (the kernel reads
        # no entry past a sequence's last block, so stale ones after it stay)
        self.inputs.send(staging, num_seqs)  # of the block tables, the real sequences' rows
        keep_samples(self.tokens, inputs, last_sampled)  # the last step may have sampled outside the decode graphs
        self.graphs[size].replay()
        v = self.inputs.vars
        return (self.hidden_states[:num_tokens], v["logits_indices"][:num_samples],
                None if temperatures is None else v["temperatures"][:num_samples])

    def release(self):
        """Destroy the graphs now (see ModelRunner.exit)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
