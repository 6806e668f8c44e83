"""CUDA graphs for decode steps: one graph per batch size, sharing static buffers that each replay refills.

A decode step of n sequences replays the graph of the smallest captured size >= n; its padding rows write no
KV (slot -1) and read one slot of block 0. A graph records the model's forward and the logits of every row,
so a decode step is one replay plus the sampler.
"""
import torch

from nanovllm.layers.attention import AttentionMetadata


class DecodeGraphs:

    @torch.inference_mode()
    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device):
        self.model = model
        max_bs = min(max_num_seqs, 512)
        # a full-length sequence's first decode needs max_model_len // block_size + 1 blocks
        max_blocks = max_model_len // block_size + 1
        self.max_model_len = max_model_len
        self.batch_sizes = sorted({*[b for b in (1, 2, 4, 8) if b < max_bs], *range(16, max_bs, 16), max_bs})
        i32 = dict(dtype=torch.int32, device=device)
        self.vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            context_lens=torch.ones(max_bs, **i32),  # capture with a valid one-token context in block 0
            block_tables=torch.zeros(max_bs, max_blocks, **i32),
            cu_seqlens_q=torch.arange(max_bs + 1, **i32),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max_bs, vocab] on rank 0; None on the other ranks
        pool = None
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up / compile
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._forward(bs)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def _forward(self, bs: int):
        g = self.vars
        meta = AttentionMetadata(slot_mapping=g["slot_mapping"][:bs], block_tables=g["block_tables"][:bs],
                                 context_lens=g["context_lens"][:bs], cu_seqlens_q=g["cu_seqlens_q"][:bs + 1],
                                 max_seqlen_q=1, max_seqlen_k=self.max_model_len)
        hidden_states = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)
        logits = self.model.compute_logits(hidden_states)
        if logits is not None:
            if self.logits is None:  # the largest batch comes first: its buffer serves every size
                self.logits = torch.empty_like(logits)
            self.logits[:bs] = logits

    def release(self):
        """Destroy the graphs now, not when a garbage collection finds them (see ModelRunner.exit)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
               ) -> torch.Tensor | None:
        """The logits of a decode step (rank 0; None on the other ranks)."""
        n = input_ids.size(0)
        bs = next(b for b in self.batch_sizes if b >= n)
        g = self.vars
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"][:bs].fill_(-1)  # padding rows write nothing
        g["slot_mapping"][:n] = meta.slot_mapping
        g["context_lens"][:bs].fill_(1)  # padding rows read one slot of block 0 and write nothing
        g["context_lens"][:n] = meta.context_lens
        g["block_tables"][:bs].zero_()  # no stale entries from an earlier, longer batch
        g["block_tables"][:n, :meta.block_tables.size(1)] = meta.block_tables
        self.graphs[bs].replay()
        return None if self.logits is None else self.logits[:n]
