"""Piecewise CUDA graphs for the steps that decode graphs do not take: prefills, chunks and mixed steps.

Attention over a varlen batch has no fixed shape, but the rest of the forward has one for a given token count.
So the model runs in pieces between its attentions (`DecoderModel.piece`), each captured once per token count
of `sizes` (as vLLM V1's piecewise graphs). A step of n tokens takes the smallest size >= n: its pieces replay
in order, and each layer's attention (and its KV store, unless a piece fused it) runs eagerly between them, on
the n real tokens, with the step's own metadata. The padding rows (stale ids and positions, slot -1) flow
through the pieces only, where rows are independent, so they change no real row; they reach no attention and
no cache slot.

The pieces hand their results over in static buffers that every size shares (the first rows of each): q, k and
v (k and v only when the attention stores them), the residual, the attention's output and the final hidden
states. So a piece's intermediates are free when it ends, and one memory pool serves every graph.
"""
from functools import partial

import torch

MAX_TOKENS = 2048  # larger steps are bound by the GPU's work, where a graph saves little


def token_counts(max_tokens: int) -> list[int]:
    """8, 16, 24, 32, 48, 64, 96, 128, ...: powers of two and their halfway points, so padding stays under a
    third of a step, up to and including `max_tokens`."""
    sizes = [8, 16]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 3 // 2 if sizes[-1] & (sizes[-1] - 1) == 0 else sizes[-2] * 2)
    return [size for size in sizes if size < max_tokens] + [max_tokens]


def capture_cuda_graph(fn, pool) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn`, which reads and writes only static buffers, run once eagerly first (lazy
    initialisation and compilation stay out of the graph)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


class PiecewiseGraphs:

    @torch.inference_mode()
    def __init__(self, model, max_tokens: int, device: torch.device, capture=None):
        """capture(fn): an object whose `replay()` does what `fn()` did and `reset()` frees it; None: a CUDA
        graph, all of them in one pool."""
        self.decoder = model.model
        attn = self.decoder.layers[0].self_attn
        hidden_size = self.decoder.embed_tokens.weight.size(1)
        dtype = self.decoder.embed_tokens.weight.dtype
        self.sizes = token_counts(max_tokens)
        n = self.sizes[-1]

        def buffer(*shape, dtype=dtype):
            return torch.zeros(n, *shape, dtype=dtype, device=device)

        self.input_ids, self.positions = buffer(dtype=torch.int64), buffer(dtype=torch.int64)
        self.slot_mapping = buffer(dtype=torch.int64) - 1
        self.q = buffer(attn.num_heads, attn.head_dim)
        self.k, self.v = buffer(attn.num_kv_heads, attn.head_dim), buffer(attn.num_kv_heads, attn.head_dim)
        self.residual, self.hidden_states = buffer(hidden_size), buffer(hidden_size)
        self.attn_out = buffer(attn.num_heads * attn.head_dim)
        if capture is None:
            capture = partial(capture_cuda_graph, pool=torch.cuda.graph_pool_handle())
        self.graphs = {}  # size: one graph per piece; the largest first, so that smaller ones reuse its memory
        for size in reversed(self.sizes):
            self.graphs[size] = [capture(partial(self._piece, i, size)) for i in range(len(self.decoder.layers) + 1)]

    def _piece(self, i: int, n: int):
        decoder = self.decoder
        x = self.input_ids[:n] if i == 0 else self.attn_out[:n]
        out = decoder.piece(i, self.positions[:n], self.slot_mapping[:n], x, self.residual[:n] if i else None)
        if i == len(decoder.layers):
            self.hidden_states[:n] = out
            return
        q, k, v, residual = out
        self.q[:n], self.residual[:n] = q, residual
        if not decoder.layers[i].self_attn.attn.fused_store:  # else k and v are in the cache: not read again
            self.k[:n], self.v[:n] = k, v

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The final hidden states of a step's tokens (a view of a static buffer, valid until the next run)."""
        n = len(input_ids)
        size = next(size for size in self.sizes if size >= n)
        graphs = self.graphs[size]
        self.input_ids[:n], self.positions[:n], self.slot_mapping[:n] = input_ids, positions, meta.slot_mapping
        self.slot_mapping[n:size] = -1  # a fused store writes no padding row
        for layer, graph in zip(self.decoder.layers, graphs):
            graph.replay()
            self.attn_out[:n] = layer.self_attn.attn(self.q[:n], self.k[:n], self.v[:n], meta)
        graphs[-1].replay()
        return self.hidden_states[:n]

    def release(self):
        """Destroy the graphs now (see ModelRunner.exit)."""
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()
