"""CUDA graphs for decode steps: one graph per batch size, sharing static buffers that each replay refills.

A decode step of n sequences replays the graph of the smallest captured size >= n; its padding rows write no
KV (slot -1), read one slot of block 0 and sample greedily. A graph records, on rank 0 with a Triton sampler:
- the input ids, where a sequence's token is still on the device (pending, sampled by the last step) read
  from `tokens`, the last step's samples;
- the model's forward and the logits of every row (kept for batches that are not plain);
- the plain sampler over those logits at the static temperatures, into `tokens`: for a plain batch the
  replay yields the sampled ids, and the next replay reads its pending tokens from there without a copy.
The host fills every static input (ids, positions, slots, pending rows, context lengths, temperatures, block
tables) with one host-to-device copy: they are views of one device buffer, laid out as its pinned mirror.
Where the backend runs short contexts more cheaply (`context_bounds`: the Triton decode kernel's fewer splits), a
batch size also has a graph per bound on the longest context (the metadata's max_seqlen_k); a replay takes the
smallest bound that holds the step's contexts.
"""
import numpy as np
import torch

from nanovllm.engine.staging import Staging, StaticInputs
from nanovllm.engine.step_inputs import StepInputs
from nanovllm.layers.attention import AttentionMetadata
from nanovllm.layers.triton_sampler import read_pending, sample_plain

# the static inputs, each [max_bs] (block tables last, [max_bs, max_blocks], so that a replay of bs rows copies
# a prefix of the buffer), and the value of a padding row
FIELDS = (("input_ids", np.int64, 0), ("positions", np.int64, 0), ("slot_mapping", np.int64, -1),
          ("pending_rows", np.int64, -1), ("context_lens", np.int32, 1), ("temperatures", np.float32, 0))


def keep_samples(tokens: torch.Tensor, inputs: StepInputs, last_sampled: torch.Tensor):
    """Before a replay: the last step's samples into `tokens` when the step reads some and they lie elsewhere."""
    if (inputs.pending_rows >= 0).any() and last_sampled.data_ptr() != tokens.data_ptr():
        tokens[:len(last_sampled)] = last_sampled


class DecodeGraphs:

    @torch.inference_mode()
    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                 rng_state: torch.Tensor | None = None, context_bounds=None):
        """rng_state: the plain sampler's device counter (`triton_sampler`); None records no sampler.
        context_bounds(batch size): the bounds on a step's longest context below max_model_len that get graphs
        of their own (the backend's `decode_context_bounds`); None: none."""
        self.model = model
        self.rng_state = rng_state
        max_bs = min(max_num_seqs, 512)
        # a full-length sequence's first decode needs max_model_len // block_size + 1 blocks
        self.max_blocks = max_model_len // block_size + 1
        self.batch_sizes = sorted({*[b for b in (1, 2, 4, 8) if b < max_bs], *range(16, max_bs, 16), max_bs})
        self.inputs = StaticInputs([*((name, dtype, (max_bs,)) for name, dtype, _ in FIELDS),
                                    ("decode_order", np.int32, (max_bs,)),
                                    ("block_tables", np.int32, (max_bs, self.max_blocks))], device)
        self.vars = self.inputs.vars
        for name, _, pad in FIELDS:
            self.vars[name].fill_(pad)  # capture with valid padding rows: a one-token context in block 0
        self.vars["decode_order"].copy_(torch.arange(max_bs))
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # the last step's samples in, this step's out: any step samples at most max_num_seqs rows
        self.tokens = torch.zeros(max(max_num_seqs, max_bs), dtype=torch.int64, device=device)
        # each size's bounds on the longest context, max_model_len last: a graph each
        self.bounds = {bs: [b for b in (context_bounds(bs) if context_bounds else ()) if b < max_model_len]
                       + [max_model_len] for bs in self.batch_sizes}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max_bs, vocab] on rank 0; None on the other ranks
        saved_rng_state = None if rng_state is None else rng_state.clone()
        pool = None
        for bs in reversed(self.batch_sizes):
            for bound in reversed(self.bounds[bs]):
                self._forward(bs, bound)  # warm-up / compile
                self.graphs[bs, bound], pool = self._capture(bs, bound, pool)
        if rng_state is not None:
            rng_state.copy_(saved_rng_state)  # capturing draws nothing: the same draws with or without graphs

    def _capture(self, bs: int, bound: int, pool) -> tuple[torch.cuda.CUDAGraph, object]:
        """The graph of `_forward(bs, bound)`, in the memory pool that every size shares."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            self._forward(bs, bound)
        torch.cuda.synchronize()
        return graph, pool or graph.pool()

    @property
    def samples(self) -> bool:
        """Replays of rank 0 yield the plain sampler's tokens."""
        return self.rng_state is not None and self.logits is not None

    def _forward(self, bs: int, bound: int):
        g = self.vars
        input_ids = read_pending(self.tokens, g["pending_rows"][:bs], g["input_ids"][:bs])
        meta = AttentionMetadata(slot_mapping=g["slot_mapping"][:bs], block_tables=g["block_tables"][:bs],
                                 context_lens=g["context_lens"][:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                                 max_seqlen_q=1, max_seqlen_k=bound, decode_order=g["decode_order"][:bs])
        hidden_states = self.model(input_ids, g["positions"][:bs], meta)
        # into the buffer that every size shares, made by the largest batch's warm-up (eager, the first call)
        logits = self.model.compute_logits(hidden_states, None if self.logits is None else self.logits[:bs])
        if logits is not None:
            if self.logits is None:
                self.logits = logits
            if self.rng_state is not None:
                sample_plain(logits, g["temperatures"][:bs], self.rng_state, out=self.tokens[:bs])

    def release(self):
        """Destroy the graphs now, not when a garbage collection finds them (see ModelRunner.exit)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def replay(self, inputs: StepInputs, temperatures: np.ndarray | None, last_sampled: torch.Tensor,
               staging: Staging) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run a decode step: (its logits, rank 0 only; its sampled tokens, when `temperatures` (one per row, a
        plain batch) are given and the graph samples). `last_sampled`: the last step's samples."""
        n = inputs.num_seqs
        bs = next(b for b in self.batch_sizes if b >= n)
        host = self.inputs.host(staging)
        rows = dict(input_ids=inputs.input_ids, positions=inputs.positions, slot_mapping=inputs.slot_mapping,
                    pending_rows=inputs.pending_rows, context_lens=inputs.context_lens,
                    temperatures=0 if temperatures is None else temperatures)
        for name, _, pad in FIELDS:
            host[name][:n] = rows[name]
            host[name][n:bs] = pad
        # the decode kernel's programs go out longest context first, padding rows last
        host["decode_order"][:bs] = np.argsort(-host["context_lens"][:bs], kind="stable")
        host["block_tables"][:bs] = 0  # no stale entries from an earlier, longer batch
        host["block_tables"][:n, :inputs.block_tables.shape[1]] = inputs.block_tables
        self.inputs.send(staging, bs)  # of the block tables, the rows that this graph reads
        keep_samples(self.tokens, inputs, last_sampled)  # the last step may have sampled outside this graph
        longest, bounds = int(inputs.context_lens.max()), self.bounds[bs]
        self.graphs[bs, next((b for b in bounds if b >= longest), bounds[-1])].replay()
        if self.logits is None:
            return None, None
        return self.logits[:n], self.tokens[:n] if temperatures is not None and self.samples else None
