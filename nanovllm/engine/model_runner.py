"""One tensor-parallel rank: device, process group, weights, KV cache, and the forward + sample of a step.

Rank 0 lives in the caller's process and drives the others: `call(method, *args)` pickles the call into a
shared-memory buffer, wakes every worker with its Event, then runs the same method itself. Workers sit in
`loop()` until they are told to exit.
"""
import logging
import multiprocessing as mp
import os
import pickle
from contextlib import contextmanager
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.sampling_batch import build_sampling_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention, AttentionMetadata, get_backend, resolve_backend_name
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.layers.sampler import Sampler
from nanovllm.models import model_class
from nanovllm.utils.loader import load_model

logger = logging.getLogger(__name__)

SHM_SIZE = 1 << 20
CPU_KV_CACHE_SHARE = 0.25  # of available RAM, at most, for the cache on CPU


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:

    def __init__(self, config: Config, rank: int, event: Event | list[Event], dist_port: int = 0,
                 shm_name: str = ""):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.event = event
        self.block_size = config.kvcache_block_size
        self.device = torch.device(f"cuda:{rank}" if config.device == "cuda" else "cpu")
        self.dtype = config.torch_dtype
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            dist.init_process_group("nccl" if config.device == "cuda" else "gloo",
                                    init_method=f"tcp://127.0.0.1:{dist_port}",
                                    world_size=self.world_size, rank=rank)

        hf_config = config.hf_config
        with default_dtype(self.dtype), self.device:
            self.model = model_class(hf_config)(hf_config)
        load_model(self.model, config.model, config.load_format)
        self.backend = get_backend(self._backend_name())
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        if config.device == "cuda":
            self.compile_small_ops()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_vars = None
        self.allocate_kv_cache()
        if config.device == "cuda":
            self.warmup_kernels()
        if config.device == "cuda" and not config.enforce_eager and self.backend.supports_cuda_graphs:
            self.capture_cudagraphs()

        self.shm = None
        if self.world_size > 1:
            if rank == 0:
                self.shm = SharedMemory(name=shm_name, create=True, size=SHM_SIZE)
                dist.barrier()
            else:
                dist.barrier()
                self._attach_shm(shm_name)
                self.loop()

    def _backend_name(self) -> str:
        config = self.config
        name, fallback = resolve_backend_name(config.attention_backend, config.device, self.dtype, self.block_size,
                                              config.kv_cache_torch_dtype)
        if fallback and self.rank == 0:
            logger.warning(fallback)
        return name

    def compile_small_ops(self):
        """Fuse the elementwise layers and the sampler with torch.compile (CUDA only), as nano-vllm does."""
        for module in [*self.model.modules(), self.sampler]:
            if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul, Sampler)):
                module.forward = torch.compile(module.forward, dynamic=True)

    # ---- tensor-parallel plumbing -------------------------------------------------------------------
    def exit(self, workers_alive: bool = True):
        if self.shm is not None:
            self.shm.close()
            if self.rank == 0:
                self.shm.unlink()
            self.shm = None
        if dist.is_initialized():
            if workers_alive:
                dist.barrier()
            dist.destroy_process_group()
        # give the GPU memory back now: compiled forwards make reference cycles that only a gc would break
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = self.graph_vars = None
        self.graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def loop(self):
        while True:
            method_name, args = self.read_shm()
            self.call(method_name, *args)
            if method_name == "exit":
                break

    def read_shm(self):
        while not self.event.wait(1.0):
            if not mp.parent_process().is_alive():  # rank 0 is gone: nobody will ever call again
                raise SystemExit(1)
        n = int.from_bytes(self.shm.buf[0:8], "little")
        method_name, *args = pickle.loads(self.shm.buf[8:n + 8])
        self.event.clear()
        return method_name, args

    def write_shm(self, method_name: str, *args):
        data = pickle.dumps([method_name, *args])
        if len(data) + 8 > self.shm.size:
            self._grow_shm(len(data) + 8)
        self._post(data)

    def _post(self, data: bytes):
        self.shm.buf[0:8] = len(data).to_bytes(8, "little")
        self.shm.buf[8:len(data) + 8] = data
        for event in self.event:
            event.set()

    def _grow_shm(self, size: int):
        """Move to a buffer at least twice as big: the workers attach to it before the old one goes."""
        old = self.shm
        new = SharedMemory(name=f"{old.name.lstrip('/')}-{size}", create=True, size=max(size, 2 * old.size))
        self._post(pickle.dumps(["_attach_shm", new.name]))  # through the old buffer
        dist.barrier()  # every worker has attached to the new buffer and let go of the old one
        old.close()
        old.unlink()
        self.shm = new

    def _attach_shm(self, name: str):
        """A worker's side of a new buffer (rank 0 owns and unlinks every buffer)."""
        # the spawned workers share rank 0's resource tracker, which unlinks the segment if rank 0 dies
        old, self.shm = self.shm, SharedMemory(name=name)
        if old is not None:
            old.close()
            dist.barrier()

    def call(self, method_name: str, *args):
        if self.world_size > 1 and self.rank == 0:
            self.write_shm(method_name, *args)
        return getattr(self, method_name)(*args)

    # ---- KV cache -----------------------------------------------------------------------------------
    def allocate_kv_cache(self):
        config, attn_layers = self.config, self.attn_layers
        num_kv_heads, head_dim = attn_layers[0].num_kv_heads, attn_layers[0].head_dim
        kv_dtype = config.kv_cache_torch_dtype  # FP8: one byte a value, so twice the tokens in the same memory
        self.backend.check(self.block_size, head_dim, kv_dtype)
        block_bytes = 2 * len(attn_layers) * self.block_size * num_kv_heads * head_dim * kv_dtype.itemsize
        num_blocks = self._num_kv_blocks(block_bytes)
        if self.world_size > 1:  # every rank must hold the same number of blocks
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            num_blocks = int(t.item())
        capacity = num_blocks * self.block_size
        if capacity < config.max_model_len:
            if config.device == "cuda" and config.num_kvcache_blocks < 0:
                raise ValueError(
                    f"the KV cache fits {capacity} tokens ({num_blocks} blocks of {self.block_size}), fewer than "
                    f"max_model_len={config.max_model_len}; raise gpu_memory_utilization or lower max_model_len")
            logger.warning("max_model_len lowered from %d to %d: the KV cache holds %d blocks of %d tokens",
                           config.max_model_len, capacity, num_blocks, self.block_size)
            config.max_model_len = capacity
        config.num_kvcache_blocks = num_blocks
        # zeros, not empty: a kernel may read the rows past a sequence's end in its last block (then masked)
        self.kv_cache = torch.zeros(2, len(attn_layers), num_blocks, self.block_size, num_kv_heads, head_dim,
                                    dtype=kv_dtype, device=self.device)
        for i, layer in enumerate(attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _num_kv_blocks(self, block_bytes: int) -> int:
        config = self.config
        if config.num_kvcache_blocks > 0:
            return config.num_kvcache_blocks
        if config.device == "cuda":
            self.warmup_model()
            free, total = torch.cuda.mem_get_info()
            # only this process's own peak counts, so another process on the GPU cannot starve the sizing
            budget = total * config.gpu_memory_utilization - torch.cuda.max_memory_allocated()
            return max(int(budget) // block_bytes, 0)
        enough = -(-config.max_num_seqs * config.max_model_len // self.block_size)
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(min(enough, int(available * CPU_KV_CACHE_SHARE) // block_bytes), 1)

    def warmup_model(self):
        """One prefill of the largest batch, so the peak activation memory is known before sizing the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        max_tokens, max_len = self.config.max_num_batched_tokens, self.config.max_model_len
        num_seqs = min(max_tokens // max_len, self.config.max_num_seqs) or 1
        seqs = [Sequence([0] * min(max_len, max_tokens)) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq.num_tokens
        self.run(seqs)
        torch.cuda.empty_cache()

    def warmup_kernels(self):
        """Run a mixed step (a decode beside a prefill after a cached prefix) and a prefix prefill once, so
        kernels that compile on first use (flash-attn-4, torch.compile) do it here rather than mid-serving."""
        context_len = min(2 * self.block_size, self.config.num_kvcache_blocks * self.block_size)
        decode, prefill = Sequence([0] * context_len), Sequence([0] * context_len)
        for seq, num_computed in ((decode, context_len - 1), (prefill, context_len // 2)):
            seq.block_table = list(range(-(-context_len // self.block_size)))  # the cache holds nothing yet
            seq.num_computed_tokens = num_computed
            seq.num_scheduled_tokens = context_len - num_computed
        self.run([decode, prefill])
        self.run([prefill])
        self.run([decode])  # a decode-only step: backends may have a kernel of its own

    # ---- a step -------------------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence]):
        """Inputs and attention metadata of a varlen batch: each sequence computes its scheduled tokens."""
        query_lens = np.array([seq.num_scheduled_tokens for seq in seqs], dtype=np.int64)
        starts = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
        context_lens = starts + query_lens
        cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        num_tokens = int(cu_seqlens_q[-1])
        seq_index = np.repeat(np.arange(len(seqs)), query_lens)
        positions = np.arange(num_tokens) - cu_seqlens_q[seq_index] + starts[seq_index]
        input_ids = np.fromiter((t for seq in seqs for t in seq.scheduled_token_ids), np.int64, num_tokens)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)  # padding is never read
        for i, seq in enumerate(seqs):
            block_tables[i, :len(seq.block_table)] = seq.block_table
        if max_blocks:
            blocks = block_tables[seq_index, positions // self.block_size].astype(np.int64)
            slot_mapping = blocks * self.block_size + positions % self.block_size
        else:  # warm-up: no cache yet
            slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
        samples = np.array([seq.samples_this_step for seq in seqs], dtype=bool)
        logits_indices = cu_seqlens_q[1:][samples] - 1

        to_device = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            block_tables=to_device(block_tables),
            context_lens=to_device(context_lens.astype(np.int32)),
            cu_seqlens_q=to_device(cu_seqlens_q.astype(np.int32)),
            max_seqlen_q=int(query_lens.max()),
            max_seqlen_k=int(context_lens.max()),
            query_lens_host=query_lens.tolist(),
            context_lens_host=context_lens.tolist(),
        )
        return to_device(input_ids), to_device(positions), meta, to_device(logits_indices)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None] | None] | None:
        """Compute the scheduled tokens of `seqs`; rank 0 returns one sampled token per sampling sequence,
        and their logprobs when some sequence asked for them."""
        input_ids, positions, meta, logits_indices = self.prepare(seqs)
        if self.graphs and meta.max_seqlen_q == 1 and len(seqs) <= self.graph_batch_sizes[-1]:
            hidden_states = self.replay_cudagraph(input_ids, positions, meta)
        else:
            hidden_states = self.model(input_ids, positions, meta)
        if logits_indices.numel() == 0:
            return ([], None) if self.rank == 0 else None
        logits = self.model.compute_logits(hidden_states[logits_indices])
        if self.rank != 0:
            return None
        batch = build_sampling_batch([seq for seq in seqs if seq.samples_this_step], self.eos_token_ids,
                                     logits.size(1), self._to_device)
        return self.sampler.sample(logits, batch, self.generator)

    # ---- CUDA graphs for decode ---------------------------------------------------------------------
    @torch.inference_mode()
    def capture_cudagraphs(self):
        """One graph per decode batch size, sharing static buffers that each replay refills."""
        config = self.config
        max_bs = min(config.max_num_seqs, 512)
        # a full-length sequence's first decode needs max_model_len // block_size + 1 blocks
        max_blocks = config.max_model_len // self.block_size + 1
        hidden_size = config.hf_config.hidden_size
        self.graph_batch_sizes = sorted({*[b for b in (1, 2, 4, 8) if b < max_bs], *range(16, max_bs, 16), max_bs})
        i32 = dict(dtype=torch.int32, device=self.device)
        self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=self.device),
            context_lens=torch.zeros(max_bs, **i32),
            block_tables=torch.zeros(max_bs, max_blocks, **i32),
            cu_seqlens_q=torch.arange(max_bs + 1, **i32),
            outputs=torch.zeros(max_bs, hidden_size, dtype=self.dtype, device=self.device),
        )
        g = self.graph_vars
        g["context_lens"].fill_(1)  # capture with a valid one-token context in block 0
        pool = None
        for bs in reversed(self.graph_batch_sizes):
            meta = self._graph_metadata(bs)
            g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)  # warm-up / compile
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def _graph_metadata(self, bs: int) -> AttentionMetadata:
        g = self.graph_vars
        return AttentionMetadata(slot_mapping=g["slot_mapping"][:bs], block_tables=g["block_tables"][:bs],
                                 context_lens=g["context_lens"][:bs], cu_seqlens_q=g["cu_seqlens_q"][:bs + 1],
                                 max_seqlen_q=1, max_seqlen_k=self.config.max_model_len)

    def replay_cudagraph(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.size(0)
        bs = next(b for b in self.graph_batch_sizes if b >= n)
        g = self.graph_vars
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"][:bs].fill_(-1)  # padding rows write nothing
        g["slot_mapping"][:n] = meta.slot_mapping
        g["context_lens"][:bs].fill_(1)  # padding rows read one slot of block 0 and write nothing
        g["context_lens"][:n] = meta.context_lens
        g["block_tables"][:bs].zero_()  # no stale entries from an earlier, longer batch
        g["block_tables"][:n, :meta.block_tables.size(1)] = meta.block_tables
        self.graphs[bs].replay()
        return g["outputs"][:n]
