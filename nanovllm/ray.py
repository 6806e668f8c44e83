"""Data parallelism on Ray: one nano-vllm engine replica per Ray actor, fed by Ray Data's `map_batches`; README's
"Batch files" gives the contract and shows `generate` in use. Beside it: an optional `sampling_params` column of dicts
overrides fields of the default per row; a row that cannot be served gets `error` (and empty outputs), so one bad row
never fails the dataset, while an engine that raises does; restarts and retries are finite, so a batch that kills
every replica fails the run instead of looping; each replica takes two batches at once, to stay full while a batch's
last requests finish.
"""
import dataclasses
import json
import logging
import warnings

from nanovllm.batch.executor import BatchExecutor
from nanovllm.batch.intake import record
from nanovllm.batch.protocol import LineError, error_line, parse_request, read_line
from nanovllm.batch.results import signals_held
from nanovllm.sampling_params import SamplingParams


def _import_ray():
    try:
        import pyarrow
        import ray
        import ray.data
    except ImportError as e:
        raise ImportError(f"nanovllm.ray needs Ray Data, which is not installed ({e}): "
                          "pip install 'nano-vllm[ray]' (or pip install 'ray[data]')") from None
    return ray, pyarrow


class _Replica:
    """One engine in one Ray actor; its calls come from two threads at once (`submit` is thread-safe)."""

    def __init__(self, model: str, engine_args: dict):
        from nanovllm.llm import LLM
        self.llm = LLM(model, **engine_args)

    def _collect(self, handles: list) -> list[dict | Exception | None]:
        outputs = []
        try:
            for handle in handles:
                try:
                    outputs.append(handle and handle.result())
                except Exception as e:  # one that failed on its own (`RequestHandle.failed_alone`): its row's error
                    if not handle.failed_alone:
                        raise
                    outputs.append(e)
            return outputs
        except BaseException:  # an engine failure: leave nothing of this batch running
            for handle in handles:
                if handle is not None and not handle.finished:
                    handle.abort()
            raise


class _GenerateReplica(_Replica):

    def __init__(self, model: str, engine_args: dict, sampling_params: SamplingParams | None,
                 chat_template: str | None):
        super().__init__(model, engine_args)
        self.params = sampling_params or SamplingParams(**self.llm.sampling_defaults)  # as LLM.generate
        self.chat_template = chat_template

    def __call__(self, table):
        _, pa = _import_ray()
        handles, errors, prompt_lens = [], [], []
        for row in table.to_pylist():
            try:
                token_ids = self._token_ids(row)
                handles.append(self.llm.submit(token_ids, self._params(row)))
                errors.append(None)
                prompt_lens.append(len(token_ids))
            except (TypeError, ValueError) as e:  # the row's own columns, kept in the output, say which it was
                handles.append(None)
                errors.append(str(e))
                prompt_lens.append(0)
        outputs = self._collect(handles)
        for i, out in enumerate(outputs):
            if isinstance(out, Exception):
                outputs[i], errors[i] = None, f"the request failed: {type(out).__name__}: {out}"
        columns = {
            "generated_text": pa.array([o and o["text"] for o in outputs], pa.string()),
            "generated_token_ids": pa.array([o["token_ids"] if o else [] for o in outputs], pa.list_(pa.int64())),
            "finish_reason": pa.array([o and o["finish_reason"] for o in outputs], pa.string()),
            "num_prompt_tokens": pa.array(prompt_lens, pa.int64()),
            "error": pa.array(errors, pa.string()),
        }
        for name, column in columns.items():
            table = table.append_column(name, column)
        return table

    def _token_ids(self, row: dict) -> list[int]:
        prompt, messages = row.get("prompt"), row.get("messages")
        if (prompt is None) == (messages is None):
            raise ValueError("a row needs a 'prompt' or a 'messages' value (one of them)")
        if messages is not None:
            # an Arrow struct has every key any message has; None marks the ones this message lacks
            messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
            try:
                prompt = self.llm.apply_chat_template(messages, self.chat_template)
            except TypeError:
                raise
            except Exception as e:  # a template may raise anything for a conversation it rejects
                raise ValueError(f"the chat template failed: {e}") from None
        return self.llm.encode(prompt)

    def _params(self, row: dict) -> SamplingParams:
        overrides = row.get("sampling_params")
        if overrides is None:
            return self.params
        if not isinstance(overrides, dict):
            raise TypeError(f"sampling_params must be a dict of SamplingParams fields, not {type(overrides).__name__}")
        # an Arrow struct column has every key of every row; None means this row did not give it
        return dataclasses.replace(self.params, **{k: v for k, v in overrides.items() if v is not None})


class _OpenAIBatchReplica(_Replica):
    """Rows of (line, request text) in; rows of (output line, error code, completion tokens) out."""

    def __init__(self, model: str, engine_args: dict, chat_template: str | None):
        super().__init__(model, engine_args)
        self.executor = BatchExecutor(self.llm, model, chat_template)

    def __call__(self, table):
        _, pa = _import_ray()
        started = []
        for number, text in zip(table["line"].to_pylist(), table["request"].to_pylist()):
            try:  # the driver checked the line already; what needs the engine is checked here
                obj, custom_id = read_line(text, number)
                started.append(self.executor.start(parse_request(obj, custom_id, number)))
            except LineError as e:
                started.append(error_line(e.custom_id, number, e.code, e.message))
        pending = [None if isinstance(p, dict) else p for p in started]
        try:
            done = [None if p is None else self.executor.finish(p) for p in pending]
        except BaseException:
            for p in pending:
                if p is not None:
                    p.abort()
            raise
        outputs, codes, tokens = [], [], []
        for item, result in zip(started, done):
            line, n = (item, 0) if isinstance(item, dict) else result or (None, 0)  # None: aborted
            outputs.append(None if line is None else json.dumps(line, ensure_ascii=False))
            codes.append(line["error"]["code"] if line is not None and line["error"] else None)
            tokens.append(n)
        return pa.table({"output": pa.array(outputs, pa.string()), "error_code": pa.array(codes, pa.string()),
                         "completion_tokens": pa.array(tokens, pa.int64())})


def check_engine_args(model: str, engine_args: dict):
    """Raise here, not in every replica: unknown names always; bad values too where the model folder is also
    on this machine (a cluster's driver may not have it, nor the GPUs: those are the workers' to check)."""
    from nanovllm.config import Config
    on_driver = engine_args if engine_args.get("device", "auto") not in ("auto", "cuda") else \
        {**engine_args, "device": "cpu"}
    try:
        Config.from_kwargs(model, **on_driver)
    except FileNotFoundError:
        pass


def _map_replicas(dataset, replica_cls, constructor_args: tuple, engine_args: dict, concurrency: int,
                  batch_size: int, max_restarts: int, max_task_retries: int, start_timeout_s: int):
    ray, _ = _import_ray()
    for name, value in (("concurrency", concurrency), ("batch_size", batch_size), ("start_timeout_s", start_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    tp = engine_args.get("tensor_parallel_size", 1)
    device = engine_args.get("device", "auto")
    on_gpus = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    # a replica's tensor-parallel ranks are processes of its own: it reserves one GPU, or one CPU, per rank
    resources = {"num_gpus": tp, "num_cpus": 1} if on_gpus else {"num_cpus": tp}
    kind = "GPU" if on_gpus else "CPU"
    have = ray.cluster_resources().get(kind, 0)
    if have < concurrency * tp:  # an autoscaling cluster may still grow: say so, and wait (start_timeout_s)
        logging.getLogger("nanovllm").warning(
            f"{concurrency} replica(s) need {tp} {kind}(s) each; the Ray cluster has {have:g} {kind}(s) now: "
            f"waiting up to {start_timeout_s} s for them")
    with warnings.catch_warnings():
        # Ray 2.60 has no named parameter for these yet and warns that passing them is deprecated (hence
        # ray<2.64 in pyproject); its defaults retry without limit, and a batch that kills every replica would
        # then loop forever
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        mapped = dataset.map_batches(
            replica_cls, fn_constructor_args=constructor_args, batch_size=batch_size, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=concurrency, max_concurrent_calls_per_actor=2),
            max_restarts=max_restarts, max_task_retries=max_task_retries, **resources)
    # every replica must be up (resources found, weights loaded) by then: a cluster that lacks the resources
    # then fails the run instead of leaving it waiting forever (set on the dataset's context, not the global one)
    mapped.context.wait_for_min_actors_s = start_timeout_s
    return mapped


def generate(dataset, model: str, sampling_params: SamplingParams | None = None, *, concurrency: int = 1,
             batch_size: int = 64, chat_template: str | None = None, max_restarts: int = 4,
             max_task_retries: int = 4, start_timeout_s: int = 600, **engine_args):
    """`dataset` with the generated columns added (see the module's contract); lazy, as Ray Data is."""
    _import_ray()
    check_engine_args(model, engine_args)
    if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, not {type(sampling_params).__name__}")
    return _map_replicas(dataset, _GenerateReplica, (model, engine_args, sampling_params, chat_template),
                         engine_args, concurrency, batch_size, max_restarts, max_task_retries, start_timeout_s)


def init(address: str | None = None):
    """Join (or start) a Ray cluster for a batch run, with Ray Data's own progress output off."""
    ray, _ = _import_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # run_batch draws its own
    context.print_on_execution_start = False


def serve_openai_batch(items, results, stats, progress, model: str, engine_args: dict, *, replicas: int,
                       batch_size: int, chat_template: str | None = None, address: str | None = None,
                       start_timeout_s: int = 600):
    """Serve `intake` items on `replicas` engines: error lines and skips at once, then the requests, staged in
    Ray's object store one batch per block (Ray Data does not split a block between replicas), and each
    result written as its batch comes back."""
    ray, pa = _import_ray()
    check_engine_args(model, engine_args)
    init(address)
    refs, lines, texts, pending = [], [], [], 0
    for item in items:
        if item[0] == "request":
            pending += 1
            lines.append(item[1].line)
            texts.append(item[2])
            if len(lines) == batch_size:
                refs.append(ray.put(pa.table({"line": lines, "request": texts})))
                lines, texts = [], []
        else:
            record(results, stats, item)
        progress.update(stats)
    if lines:
        refs.append(ray.put(pa.table({"line": lines, "request": texts})))
    if not refs:
        return
    try:
        served = _map_replicas(ray.data.from_arrow_refs(refs), _OpenAIBatchReplica,
                               (model, engine_args, chat_template), engine_args, replicas, batch_size,
                               max_restarts=4, max_task_retries=4, start_timeout_s=start_timeout_s)
        for batch in served.iter_batches(batch_size=None, batch_format="pyarrow"):
            for output, code, tokens in zip(*(batch[name].to_pylist() for name in ("output", "error_code",
                                                                                  "completion_tokens"))):
                if output is None:  # (counted as stopped below)
                    continue
                with signals_held():  # its line is written and counted at once
                    pending -= 1
                    results.write_text(output)
                    if code is None:
                        stats.succeeded += 1
                        stats.completion_tokens += tokens
                    else:
                        stats.failed += 1
                        stats.errors[code] += 1
            progress.update(stats)
    finally:  # a signal or a failure: what has not come back is counted as stopped, as serve_locally counts it
        stats.interrupted += pending
