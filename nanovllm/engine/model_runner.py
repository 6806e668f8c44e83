"""One tensor-parallel rank: device, process group, weights, KV cache (`kv_cache.py`), the warm-up steps
(`warmup.py`), and the forward + sample of a step.

Rank 0 lives in the caller's process and drives the others: `call(method, *args)` sends the call through the
shared-memory channel (`tp_channel.py`), then runs the same method itself. Workers sit in `loop()` until they
are told to exit. A step's inputs are built on the host (`step_inputs.py`), posted to the workers as those
arrays (`run_step`), and go to the device in one copy (`staging.py`); decode steps replay CUDA graphs
(`cuda_graphs.py`), which on rank 0 also sample a plain batch; other steps replay the model's pieces between
attentions (`piecewise_graphs.py`).

`run` launches a step and returns without waiting for the device: rank 0 gets a `StepOutput` whose tokens
arrive later. Every rank keeps the step's sampled tokens on the device (the workers receive them by a
broadcast), because the next step may be launched before the host knows them: a sequence whose last token is
pending reads it from there.
"""
import faulthandler
import gc
import logging
import os
import threading
from contextlib import contextmanager
from functools import partial
from multiprocessing.synchronize import Semaphore

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine import kv_cache
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.penalty_slots import PenaltySlots
from nanovllm.engine.piecewise_graphs import MAX_TOKENS, PiecewiseGraphs
from nanovllm.engine.sampling_batch import build_sampling_batch, is_plain
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.staging import Staging
from nanovllm.engine.step_inputs import StepInputs, step_inputs
from nanovllm.engine.step_output import StepOutput
from nanovllm.engine.tp_channel import Channel
from nanovllm.engine.varlen_graphs import VarlenGraphs
from nanovllm.engine.warmup import kernel_warmup_steps, sizing_prefill
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention, AttentionMetadata, get_backend, resolve_backend_name
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.layers.sampler import Sampler, SamplingBatch
from nanovllm.layers.triton_activation import silu_and_mul
from nanovllm.layers.triton_guard import triton_available
from nanovllm.layers.triton_sampler import make_rng_state
from nanovllm.models import model_class
from nanovllm.utils import parallel
from nanovllm.utils.loader import load_model

logger = logging.getLogger(__name__)

ARRIVED = "nanovllm-workers-arrived"  # the rendezvous' count of workers that reached it
DEVICE_FREE_TIMEOUT = 5  # s that rank 0 gives its GPU to finish after a worker died


def abort_process_group():
    """Free whatever waits in an NCCL collective for a peer that died (it returns garbage), and end the group.
    gloo's collectives fail on their own."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:

    def __init__(self, config: Config, rank: int, semaphores: list[tuple[Semaphore, Semaphore]] = (),
                 dist_port: int = 0, shm_name: str = "", store: dist.TCPStore | None = None):
        if rank:
            faulthandler.enable()  # a worker that crashes in native code says where, on its stderr (the caller's)
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.device = torch.device(f"cuda:{rank}" if config.device == "cuda" else "cpu")
        self.dtype = config.torch_dtype
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            if store is None:  # a worker: check in at rank 0's rendezvous (rank 0 passes its own)
                store = dist.TCPStore("127.0.0.1", dist_port, self.world_size, is_master=False)
                store.add(ARRIVED, 1)
            dist.init_process_group("nccl" if config.device == "cuda" else "gloo", store=store,
                                    world_size=self.world_size, rank=rank)

        hf_config = config.hf_config
        with default_dtype(self.dtype), self.device, parallel.building(rank, self.world_size):
            self.model = model_class(hf_config)(hf_config)
        load_model(self.model, config.model, config.load_format)
        self.backend = get_backend(self._backend_name())
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # the q/k norms, rope and the KV store in one kernel where the backend's store is Triton's (decode steps 5%
        # faster); NANOVLLM_FUSED_ROPE_STORE=0 turns it off, for comparison and debugging
        fuse = self.backend.fuses_rope_store and os.environ.get("NANOVLLM_FUSED_ROPE_STORE", "1") != "0"
        for layer in self.attn_layers:
            layer.backend, layer.fuse_rope_store = self.backend, fuse
        # on CUDA the plain rows' draws come from a counter on the device, so a CUDA graph can replay them
        self.sampler = Sampler(make_rng_state(config.seed, self.device)
                               if config.device == "cuda" and triton_available() else None)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.sampled = torch.zeros(0, dtype=torch.int64, device=self.device)  # the last step's tokens
        # histories of penalized sequences (rank 0's), allocated on first use; max_model_len is a bound (the
        # KV cache may lower it below)
        self.penalty_slots = PenaltySlots(hf_config.vocab_size, config.max_model_len, config.max_num_seqs,
                                          self.device)
        self.staging = Staging(self.device)  # a step's inputs go to the device in one copy
        if config.device == "cuda":
            self.compile_small_ops()
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.varlen_graphs: VarlenGraphs | None = None
        self.channel: Channel | None = None  # none yet while each rank warms up on its own (CUDA's cache sizing)
        self.allocate_kv_cache()
        if config.device == "cuda":
            self.warmup_kernels()
        if config.device == "cuda" and not config.enforce_eager and self.backend.supports_cuda_graphs:
            # NANOVLLM_GRAPH_SAMPLER=0 leaves the sampler out of the graphs (for comparison and debugging)
            sample_in_graph = os.environ.get("NANOVLLM_GRAPH_SAMPLER", "1") != "0"
            attn = self.attn_layers[0]
            bounds = partial(self.backend.decode_context_bounds, num_kv_heads=attn.num_kv_heads,
                             kv_itemsize=attn.k_cache.element_size(), device=self.device)
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, config.max_model_len, self.block_size,
                                       self.device, self.sampler.rng_state if sample_in_graph else None, bounds)
        # prefills and mixed steps replay the model's pieces, attention runs eagerly between them, so any backend
        # will do (a far lower ITL p99); NANOVLLM_PIECEWISE_GRAPHS=0 turns them off
        if (config.device == "cuda" and not config.enforce_eager
                and os.environ.get("NANOVLLM_PIECEWISE_GRAPHS", "1") != "0"):
            self.piecewise = PiecewiseGraphs(self.model, min(MAX_TOKENS, config.max_num_batched_tokens),
                                             self.device)
        # and the small ones, where attention is Triton's varlen kernel, replay one graph each (`varlen_graphs`);
        # NANOVLLM_VARLEN_GRAPHS=0 turns them off
        if (self.piecewise is not None and self.backend.varlen_graph_tokens
                and os.environ.get("NANOVLLM_VARLEN_GRAPHS", "1") != "0"):
            self.varlen_graphs = VarlenGraphs(
                self.model, min(MAX_TOKENS, config.max_num_batched_tokens, self.backend.varlen_graph_tokens),
                config.max_num_seqs, config.max_model_len, self.block_size, self.device,
                self.graphs.tokens if self.graphs is not None else None)

        self.channel = Channel(shm_name, rank, semaphores) if self.world_size > 1 else None
        # rank 0: the error that ended its part of a step that the workers run too (`run`), if one did
        self.out_of_step: BaseException | None = None
        # what exists now (weights, graphs, compiled code) lives as long as the engine: frozen out of the garbage
        # collector's sight, a full collection while serving walks only what serving made (`exit` thaws it)
        gc.collect()
        gc.freeze()
        if self.world_size > 1 and rank:
            self.loop()

    def _backend_name(self) -> str:
        config = self.config
        name, fallback = resolve_backend_name(config.attention_backend, config.device, self.dtype, self.block_size,
                                              config.kv_cache_torch_dtype)
        if fallback and self.rank == 0:
            logger.warning(fallback)
        return name

    def compile_small_ops(self):
        """Fuse the elementwise layers (CUDA only): silu(gate) * up into one Triton kernel (`triton_activation`
        says why), the others with torch.compile, as nano-vllm does.
        NANOVLLM_TRITON_SILU=0 compiles silu too, for comparison."""
        triton_silu = triton_available() and os.environ.get("NANOVLLM_TRITON_SILU", "1") != "0"
        for module in self.model.modules():
            if triton_silu and type(module) is SiluAndMul:
                module.forward = silu_and_mul
            elif isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul)):
                module.forward = torch.compile(module.forward, dynamic=True)

    # ---- tensor-parallel plumbing ----
    def exit(self, workers_alive: bool = True):
        gc.unfreeze()  # this engine's cycles (compiled forwards hold the model) can be collected again
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.device.type == "cuda" and not workers_alive:
            # a worker is gone: the watch's abort lets NCCL's kernels that waited for it exit, but the abort
            # itself may never return (seen still waiting for the dead peer after 30 s, the device idle), so the
            # process group stays and the device is freed only if it answers in time
            freed = threading.Thread(target=self._free_device, daemon=True, name="nanovllm-free-device")
            freed.start()
            freed.join(DEVICE_FREE_TIMEOUT)
            if freed.is_alive():
                logger.warning("the GPU did not finish its work within %d s of a worker's death: its memory stays "
                               "held until this process exits", DEVICE_FREE_TIMEOUT)
            return
        self._free_device()
        if self.world_size > 1 and dist.is_initialized():  # (not a TP>1 engine's beside this one)
            if workers_alive:
                dist.barrier()
            dist.destroy_process_group()

    def _free_device(self):
        # the graphs go first: NCCL does not destroy a communicator while a graph that captured its collectives
        # lives (destroy_process_group then hangs: pytorch issue 115388)
        for graphs in (self.graphs, self.piecewise, self.varlen_graphs):
            if graphs is not None:
                graphs.release()
        # give the GPU memory back now: compiled forwards make reference cycles that only a gc would break
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = self.graphs = self.piecewise = self.varlen_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def abort_collectives(self):
        """From another thread, when a worker has died: a step waiting for the workers returns or raises (in an
        NCCL collective: it returns, and its results are garbage; gloo's collectives fail on their own), and so
        does every later one."""
        channel = self.channel
        if channel is not None:
            channel.abort()
        abort_process_group()

    def describe(self) -> list[dict]:
        """Every rank's device, captured graphs (decode: batch sizes; piecewise: token counts) and channel
        traffic (rank 0 gathers them)."""
        channel = self.channel
        info = dict(rank=self.rank, device=str(self.device), graphs=self.graphs.batch_sizes if self.graphs else [],
                    piecewise_graphs=self.piecewise.sizes if self.piecewise else [],
                    varlen_graphs=self.varlen_graphs.sizes if self.varlen_graphs else [],
                    channel_calls=channel.num_calls if channel else 0,
                    channel_seconds=channel.seconds if channel else 0.0)
        if self.world_size == 1:
            return [info]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, info)
        return gathered

    def loop(self):
        while True:
            method_name, args = self.channel.receive()
            self.call(method_name, *args)
            if method_name == "exit":
                break

    def _attach_shm(self, name: str):
        self.channel.attach(name)

    def call(self, method_name: str, *args):
        if self.world_size > 1 and self.rank == 0:
            self.channel.post(method_name, *args)
        return getattr(self, method_name)(*args)

    # ---- KV cache and warm-up ----
    def allocate_kv_cache(self):
        config, attn_layers, dtype = self.config, self.attn_layers, self.config.kv_cache_torch_dtype
        self.backend.check(self.block_size, attn_layers[0].head_dim, dtype)
        num_blocks = self._num_kv_blocks(kv_cache.block_bytes(attn_layers, self.block_size, dtype))
        if self.world_size > 1:  # every rank must hold the same number of blocks
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            num_blocks = int(t.item())
        kv_cache.fit_to_blocks(config, num_blocks, self.block_size)
        self.kv_cache = kv_cache.make_kv_cache(attn_layers, num_blocks, self.block_size, dtype, self.device)

    def _num_kv_blocks(self, block_bytes: int) -> int:
        config = self.config
        if config.num_kvcache_blocks > 0:
            return config.num_kvcache_blocks
        if config.device != "cuda":
            return kv_cache.cpu_blocks(config, self.block_size, block_bytes)
        self.warmup_model()
        free, total = torch.cuda.mem_get_info()
        # only this process's own peak counts, so another process on the GPU cannot starve the sizing
        budget = total * config.gpu_memory_utilization - torch.cuda.max_memory_allocated()
        return max(int(budget) // block_bytes, 0)

    def warmup_model(self):
        """One prefill of the largest batch, so the peak activation memory is known before sizing the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.run(sizing_prefill(self.config))
        torch.cuda.empty_cache()

    def warmup_kernels(self):
        """Each step of `warmup.kernel_warmup_steps`, so that kernels compiled on first use compile now."""
        for seqs in kernel_warmup_steps(self.config, self.block_size):
            self.run(seqs)

    # ---- a step ----
    def prepare(self, inputs: StepInputs, temperatures: np.ndarray | None):
        """The device tensors of a varlen step, in one copy: input ids (a pending token read where the last step
        sampled it), positions, attention metadata, logits indices, and the temperatures of a plain batch."""
        pending = inputs.pending_rows >= 0
        (input_ids, positions, slot_mapping, block_tables, context_lens, cu_seqlens_q, logits_indices,
         pending_tokens, pending_rows, *plain) = self.staging.to_device(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.context_lens,
            inputs.cu_seqlens_q, inputs.logits_indices, inputs.cu_seqlens_q[1:][pending].astype(np.int64) - 1,
            inputs.pending_rows[pending], *(() if temperatures is None else (temperatures,)))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=block_tables, context_lens=context_lens,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=int(inputs.query_lens.max()),
            max_seqlen_k=int(inputs.context_lens.max()), query_lens_host=inputs.query_lens.tolist(),
            context_lens_host=inputs.context_lens.tolist(), num_decodes=inputs.num_leading_decodes)
        if pending.any():  # a pending token is its sequence's one scheduled token
            input_ids[pending_tokens] = self.sampled[pending_rows]
        return input_ids, positions, meta, logits_indices, plain[0] if plain else None

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """One array on its own (the sampling controls of a batch that is not plain)."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def replay(self, inputs: StepInputs, temperatures: np.ndarray | None):
        """A decode step by graph replay: its logits (rank 0), the tokens when the graph drew them, and the
        temperatures of a plain batch on the device (the graph's inputs carried them)."""
        num_samples = len(inputs.logits_indices)
        if num_samples < inputs.num_seqs:  # a one-token chunk of a prompt samples nothing: the full sampler
            temperatures = None
        logits, sampled = self.graphs.replay(inputs, temperatures, self.sampled, self.staging)
        if logits is not None and num_samples < inputs.num_seqs:
            logits = logits[self._to_device(inputs.logits_indices)]
        return logits, sampled, None if temperatures is None else self.graphs.vars["temperatures"][:num_samples]

    def run(self, seqs: list[Sequence]) -> StepOutput | None:
        """Launch the computation of the scheduled tokens of `seqs`; returns the step's samples, one per sampling
        sequence, without waiting for them. The workers get the step's inputs, a few arrays, not the sequences
        (far cheaper to pickle: `git show 648ba5f:benchmarks/host_work.py`)."""
        inputs = step_inputs(seqs, self.block_size)
        sampling = [seq for seq in seqs if seq.samples_this_step]
        if self.channel is None:
            return self.run_step(inputs, sampling)
        self.channel.post("run_step", inputs)
        try:
            return self.run_step(inputs, sampling)
        except BaseException as error:
            # the workers run this step too and may wait for good in a collective that rank 0 never reaches; the
            # next step's collectives would pair with theirs out of step (gloo aborts the process on mismatched
            # sizes): the engine cannot go on
            self.out_of_step = error
            raise

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs, sampling: list[Sequence] = ()) -> StepOutput | None:
        """A step on this rank; `sampling`: rank 0's sequences that sample in it, in order."""
        num_samples = len(inputs.logits_indices)
        temperatures = (np.array([seq.params.temperature for seq in sampling], dtype=np.float32)
                        if sampling and is_plain(sampling) else None)
        graph_step = self.graphs is not None and inputs.is_decode and self.graphs.fits(inputs.num_seqs)
        if graph_step:
            logits, sampled, temperatures = self.replay(inputs, temperatures)
        else:
            if self.varlen_graphs is not None and self.varlen_graphs.fits(inputs):
                hidden_states, logits_indices, temperatures = self.varlen_graphs.run(inputs, temperatures,
                                                                                     self.sampled, self.staging)
            else:
                input_ids, positions, meta, logits_indices, temperatures = self.prepare(inputs, temperatures)
                piecewise = self.piecewise is not None and self.piecewise.fits(len(input_ids))
                hidden_states = (self.piecewise.run(input_ids, positions, meta) if piecewise else
                                 self.model(input_ids, positions, meta))
            logits = self.model.compute_logits(hidden_states[logits_indices]) if num_samples else None
            sampled = None
        if self.rank == 0 and num_samples:
            logprobs = num_logprobs = None
            if sampled is None:  # a graph samples only a plain batch, which has no penalties
                batch = (SamplingBatch(temperatures) if temperatures is not None else
                         build_sampling_batch(sampling, self.eos_token_ids, logits.size(1), self._to_device,
                                              self.penalty_slots))
                sampled, logprobs = self.sampler.sample(logits, batch, self.generator)
                if batch.penalties is not None:
                    self.penalty_slots.append(batch.penalties, sampled)
                num_logprobs = batch.num_logprobs
            self.sampled = sampled
            output = StepOutput(sampled, logprobs, num_logprobs)
        else:  # the workers receive rank 0's samples; after a graph step, where the next replay reads them
            self.sampled = (self.graphs.tokens[:num_samples] if graph_step else
                            torch.empty(num_samples, dtype=torch.int64, device=self.device))
            output = StepOutput(self.sampled) if self.rank == 0 else None
        if self.world_size > 1 and num_samples:
            dist.broadcast(self.sampled, 0)  # the workers' next step may read pending tokens from it
        return output
