"""A resumable batch runner for files of OpenAI Batch requests (the format of vLLM's `run-batch`):

    python -m nanovllm.run_batch -i requests.jsonl -o results.jsonl --model PATH [--max-model-len 4096 ...]

Its contract is README's "Batch files": one output line per input line (an error line for one that cannot be
served), appended and flushed as each finishes, what the output holds skipped on a rerun, at most --max-in-flight
requests in the engine; exit status 0, 1 (some line failed), 2 (bad command line), 3 (stopped early: run it again),
130 on Ctrl-C, 143 on SIGTERM (both stop cleanly: requests in flight are dropped, to be served by the next run).
Engine arguments are Config's fields as --kebab-case flags, so a new engine argument is a flag at once.
`--data-parallel-size N` serves the file on N engine replicas through Ray (`nanovllm.ray`).
"""
import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
import typing
from dataclasses import MISSING, fields
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.batch.executor import BatchExecutor
from nanovllm.batch.intake import EOF, Reader, Stats, intake, record
from nanovllm.batch.protocol import LineError, error_line
from nanovllm.batch.results import ResultsFile, signals_held
from nanovllm.config import Config

NOT_ENGINE_ARGUMENTS = {"model", "hf_config", "eos_token_ids"}  # set by the engine, not by its caller


def add_engine_arguments(parser: argparse.ArgumentParser, config_cls=Config) -> list[str]:
    """One --kebab-case flag per engine argument of `config_cls`, typed by its annotation; returns the names.
    Flags that are not given stay out of the namespace, so the engine's own defaults apply."""
    group = parser.add_argument_group("engine arguments (as LLM(model, **kwargs) takes them)")
    hints = typing.get_type_hints(config_cls)
    names = []
    for f in fields(config_cls):
        if f.name in NOT_ENGINE_ARGUMENTS:
            continue
        kind = hints[f.name]
        options = typing.get_args(kind)
        if type(None) in options and len(options) == 2:  # Optional[X] takes X
            kind = next(option for option in options if option is not type(None))
        default = f.default if f.default is not MISSING else None
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"(default: {default})")
        elif kind in (int, float, str):
            group.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                               help=f"(default: {default!r})")
        elif typing.get_origin(kind) is typing.Literal:
            choices = typing.get_args(kind)
            group.add_argument(flag, type=type(choices[0]), choices=choices, default=argparse.SUPPRESS,
                               help=f"(default: {default!r})")
        else:  # a list, a dict, ...: written as JSON, and checked by Config like any other value
            group.add_argument(flag, type=json.loads, default=argparse.SUPPRESS, metavar="JSON",
                               help=f"(default: {default!r})")
        names.append(f.name)
    return names


def build_parser(config_cls=Config) -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.run_batch", allow_abbrev=False,  # a misspelt flag must not match another
        description="Serve a file of OpenAI Batch requests (one JSON object per line) with nano-vllm.",
        epilog="Exit status: 0 every line succeeded, 1 some line failed (see its error), 2 bad command line, "
               "3 stopped early (run the same command again to finish), 130 Ctrl-C, 143 SIGTERM.")
    parser.add_argument("-i", "--input-file", required=True, help="requests, JSON lines; '-' reads stdin")
    parser.add_argument("-o", "--output-file", required=True,
                        help="results, JSON lines, appended; a second run resumes it. '-' writes stdout "
                             "(nothing can then be resumed)")
    parser.add_argument("--model", required=True, help="model folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                        help="requests in the engine at once (default: 2 x max_num_seqs)")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one "
                        "(default: the tokenizer's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                        help="engine replicas on Ray (nano-vllm[ray]); each takes tensor_parallel_size GPUs")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to join, e.g. 'auto' (default: RAY_ADDRESS, else a local one)")
    parser.add_argument("--ray-start-timeout", type=int, default=600, metavar="S",
                        help="seconds for every replica to start (resources found, weights loaded) before the run "
                             "fails (default: 600)")
    return parser, add_engine_arguments(parser, config_cls)


class Progress:
    def __init__(self, total: int | None, disable: bool):
        # a redirected stderr (a log file) gets a line every 30 s, not a flood
        self.bar = tqdm(total=total, desc="run_batch", unit="line", file=sys.stderr, dynamic_ncols=True,
                        disable=disable, mininterval=0.5 if sys.stderr.isatty() else 30)
        self.start = self.last = perf_counter()

    def update(self, stats: Stats, force: bool = False):
        if not force and perf_counter() - self.last < 0.1:  # called per line when resuming or staging
            return
        self.last = perf_counter()
        self.bar.set_postfix({"failed": stats.failed + stats.skipped_failed,
                              "tok/s": int(stats.completion_tokens / max(perf_counter() - self.start, 1e-9))},
                             refresh=False)
        self.bar.update(stats.lines - self.bar.n)

    def close(self):
        self.bar.close()


def serve_locally(llm, items, results: ResultsFile, stats: Stats, progress: Progress, max_in_flight: int,
                  model_name: str, chat_template: str | None = None):
    """Serve `intake` items on one engine, at most `max_in_flight` requests at once, writing each result
    when it finishes. On any exception (an engine failure, Ctrl-C) the requests in flight are aborted and
    counted as interrupted, and the exception propagates."""
    executor = BatchExecutor(llm, model_name, chat_template)
    reader = Reader(items, maxsize=max_in_flight)
    in_flight, eof = [], False
    try:
        while not eof or in_flight:
            busy = False
            while not eof and len(in_flight) < max_in_flight:
                try:  # with nothing in flight, wait for input; else keep collecting results
                    item = reader.queue.get(block=not in_flight, timeout=0.1)
                except queue.Empty:
                    break
                busy = True
                if item is EOF:
                    eof = True
                elif isinstance(item, BaseException):
                    raise item
                elif item[0] != "request":
                    record(results, stats, item)
                else:
                    try:
                        in_flight.append(executor.start(item[1]))
                    except LineError as e:
                        record(results, stats, ("error", error_line(e.custom_id, item[1].line, e.code, e.message)))
            still_running = []
            for index, pending in enumerate(in_flight):
                if not pending.finished:
                    still_running.append(pending)
                    continue
                busy = True
                with signals_held():  # its line is written, counted and out of in_flight at once
                    done = executor.finish(pending)
                    if done is None:
                        stats.interrupted += 1
                    elif done[0]["error"] is not None:  # it failed on its own (`BatchExecutor.finish`)
                        record(results, stats, ("error", done[0]))
                    else:
                        results.write(done[0])
                        stats.succeeded += 1
                        stats.completion_tokens += done[1]
                    in_flight[index] = None
            in_flight = still_running
            progress.update(stats)
            if not busy:
                time.sleep(0.02)  # handles have no callback to wait on; scanning them is cheap at this rate
    except BaseException:
        in_flight = [pending for pending in in_flight if pending is not None]
        for pending in in_flight:
            pending.abort()
        stats.interrupted += len(in_flight)
        raise
    finally:
        reader.stop()


def count_lines(path: str) -> int | None:
    """The progress bar's total: the lines that are not blank, which `intake` reads as requests."""
    if path == "-" or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def summary(stats: Stats, seconds: float, output: str) -> str:
    errors = ", ".join(f"{code} {n}" for code, n in sorted(stats.errors.items()))
    text = (f"run_batch: {stats.lines} lines: {stats.succeeded} served, {stats.failed} failed"
            + (f" ({errors})" if errors else ""))
    if stats.skipped:
        text += f"; {stats.skipped} written by an earlier run ({stats.skipped_failed} of them failed)"
    if stats.interrupted:
        text += f"; {stats.interrupted} stopped before they finished: run the same command again to finish them"
    return (text + f"; {stats.completion_tokens} completion tokens in {seconds:.1f} s "
            f"({stats.completion_tokens / max(seconds, 1e-9):.0f} tok/s); results in {output}")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so that the run stops as cleanly as on Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated()


def _interrupted(e: KeyboardInterrupt) -> int:
    return 143 if isinstance(e, Terminated) else 130


def main(argv: list[str] | None = None, llm=None) -> int:
    """The command line; returns the exit status. `llm`: serve on this engine (its own arguments apply, and it
    stays open) instead of building one, for programs and tests that hold an engine already."""
    parser, engine_names = build_parser()
    args = parser.parse_args(argv)
    engine_args = {name: getattr(args, name) for name in engine_names if hasattr(args, name)}
    if args.input_file != "-" and not os.path.exists(args.input_file):  # a FIFO is fine
        parser.error(f"input file {args.input_file!r} does not exist")
    if args.input_file != "-" and os.path.isdir(args.input_file):  # else exit 3, after loading the model
        parser.error(f"input file {args.input_file!r} is a folder")
    if args.output_file != "-" and args.input_file != "-" and os.path.exists(args.output_file) \
            and os.path.samefile(args.input_file, args.output_file):
        parser.error("the output file is the input file: results are appended, so that would destroy it")
    for name in ("max_in_flight", "data_parallel_size", "ray_start_timeout"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.chat_template is not None and os.path.isfile(args.chat_template):
        with open(args.chat_template) as f:
            args.chat_template = f.read()
    elif args.chat_template is not None and not any(c in args.chat_template for c in "{}\n"):  # as vLLM
        parser.error(f"--chat-template {args.chat_template!r} is neither a file nor a template")
    stdout_fd = None
    if args.output_file == "-":  # results own stdout; whatever else prints (a library, Ray) goes to stderr
        stdout_fd = os.dup(1)
        os.dup2(2, 1)
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args, engine_args, stdout_fd, llm)
    except KeyboardInterrupt as e:  # before the run (reading back the results, starting the engine), or held
        return _interrupted(e)  # to the clean-up's end
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
        if stdout_fd is not None:
            os.dup2(stdout_fd, 1)
            os.close(stdout_fd)


def _run(args, engine_args: dict, stdout_fd: int | None, given_llm) -> int:
    try:  # the output first: a locked or foreign file is an error before any model loads
        results = ResultsFile.stdout(os.dup(stdout_fd)) if stdout_fd is not None else ResultsFile.open(args.output_file)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"run_batch: error: {e}", file=sys.stderr)
        return 2
    max_num_seqs = engine_args.get("max_num_seqs", Config.default("max_num_seqs"))
    max_in_flight = args.max_in_flight or 2 * max_num_seqs
    llm, source, progress = given_llm, None, None
    stats, start, code = Stats(), perf_counter(), 0
    try:
        try:
            if llm is None and args.data_parallel_size == 1:
                from nanovllm.llm import LLM
                llm = LLM(args.model, **engine_args)
            elif llm is None:
                from nanovllm import ray as nanovllm_ray
                nanovllm_ray.check_engine_args(args.model, engine_args)
                nanovllm_ray.init(args.ray_address)
        except (ValueError, TypeError, FileNotFoundError, ImportError) as e:  # a bad engine argument, Ray missing
            print(f"run_batch: error: {e}", file=sys.stderr)
            return 2
        source = sys.stdin.buffer if args.input_file == "-" else open(args.input_file, "rb")
        progress = Progress(count_lines(args.input_file), disable=args.no_progress)
        items = intake(source, results.done)
        if llm is not None:
            serve_locally(llm, items, results, stats, progress, max_in_flight, args.model, args.chat_template)
        else:  # each replica takes two batches at once: max_in_flight requests in its engine
            nanovllm_ray.serve_openai_batch(items, results, stats, progress, args.model, engine_args,
                                            replicas=args.data_parallel_size, batch_size=max(max_in_flight // 2, 1),
                                            chat_template=args.chat_template, address=args.ray_address,
                                            start_timeout_s=args.ray_start_timeout)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (a scheduler's preemption): requests in flight are
        code = _interrupted(e)  # aborted, and the engine closes cleanly
    except Exception as e:  # an engine failure: what finished is written, a second run does the rest
        print(f"\nrun_batch: the run stopped: {type(e).__name__}: {e}", file=sys.stderr)
        code = 3
    finally:
        with signals_held():  # a signal now waits until all is closed and the summary printed (main: 130, 143)
            if progress is not None:
                progress.update(stats, force=True)
                progress.close()
            if llm is not None and llm is not given_llm:
                llm.close()
            results.close()
            if source is not None and source is not sys.stdin.buffer:
                source.close()
            if source is not None:
                print(summary(stats, perf_counter() - start, results.name), file=sys.stderr)
    return code or (3 if stats.interrupted else 1 if stats.any_failed else 0)


if __name__ == "__main__":
    sys.exit(main())
