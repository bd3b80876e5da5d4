"""`toppings-serve`: build one engine from the command line and serve its HTTP API with waitress.

The first SIGTERM or SIGINT drains: `/health` turns 503, new requests get 503, and requests in
flight run to their end (at most `--drain-timeout` seconds) while waitress keeps streaming them;
then waitress and the engine stop and the command exits 0. A second signal kills at once.

Waitress runs one thread per generation request in flight (`--max-concurrent-requests`, 429 past
it) plus `--threads` more for everything else, so that the front end never caps the batch and
/health, /stats and /metrics answer however many streams are open (see server.http.frontend).
It is waitress's server with a header deadline (`--header-timeout`, server.http.waitress_server):
clients that send half a header and stall cannot hold every connection.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

from toppings.server.cli_args import ServeConfig, build_parser, parse_configs
from toppings.server.config import WORKER_SPINCOUNT, EngineConfig
from toppings.server.http.drain import Drainer
from toppings.server.http.frontend import (
    default_max_in_flight,
    raise_open_files_limit,
    waitress_settings,
)
from toppings.server.http.listen import listen_error, listen_problem
from toppings.server.http.waitress_server import GuardedServer

if TYPE_CHECKING:
    from flask import Flask

    from toppings.server.engine.engine import Engine

logger = logging.getLogger("toppings-serve")

HANDLER_GRACE_S = 10.0  # after the drain, how long handlers may take to write their last bytes


def _usage_error(message: str) -> NoReturn:
    """A user mistake: one line on stderr and exit status 2, as argparse does (no traceback)."""
    print(f"toppings-serve: error: {message}", file=sys.stderr)
    sys.exit(2)


def _check_inputs(model: str, loras: dict[str, str]) -> None:
    """Check the model and every adapter's config before anything heavy loads."""
    from transformers import AutoConfig

    from toppings.gpu_lora.peft.config import AdapterError, read_adapter_config
    from toppings.server.model.config import ModelConfig
    from toppings.server.model.loader import resolve_model_dir

    for name, path in loras.items():
        try:
            read_adapter_config(path)
        except AdapterError as e:
            _usage_error(f"adapter {name}: {e}")
    try:
        model_dir = resolve_model_dir(model)
    except FileNotFoundError as e:
        _usage_error(f"--model: {e}")
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers' own validation raises types of its own
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _usage_error(f"--model {model}: transformers cannot read its config.json: {first_line}")
    try:
        ModelConfig.from_hf(hf_config, model_dir.name)
    except (OSError, ValueError, KeyError) as e:
        _usage_error(f"--model {model}: not a model this server runs: {e}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        serve, config, options = parse_configs(args)
    except ValueError as e:
        _usage_error(str(e))
    if config.num_cpu_workers:
        # The workers share cores with the engine's OpenMP threads, which busy-wait after each
        # parallel region (libgomp's default spin starved them). A short spin before they sleep
        # leaves the cores to the workers when the engine waits on them, and keeps the threads
        # awake between a decode step's regions, which OMP_WAIT_POLICY=PASSIVE did not (what
        # each costs: docs/benchmarks.md). It must be set before torch starts OpenMP.
        os.environ.setdefault("GOMP_SPINCOUNT", WORKER_SPINCOUNT)
    loras = served_adapters(serve)
    if config.device == "cuda":  # (torch imported after GOMP_SPINCOUNT, as the engine's is)
        import torch

        if not torch.cuda.is_available():
            built = "built without CUDA" if torch.version.cuda is None else "finds no GPU"
            _usage_error(f"--device cuda: this torch ({torch.__version__}) {built}")
    if problem := listen_problem(serve.host, serve.port):  # before the model loads, not after
        _usage_error(f"--port: {problem}")
    _check_inputs(serve.model, loras)
    engine = load_engine(serve, config, loras)
    from toppings.server.api.app import create_app  # after parsing: `--help` loads no torch
    from toppings.server.process.gc_heap import freeze_startup_heap, thaw_heap

    app = create_app(engine, options)
    freeze_startup_heap()  # the model, tokenizer, engine and app: out of every collection
    max_in_flight = options.max_concurrent_requests or default_max_in_flight(config.max_batch_size)
    try:
        serve_until_drained(app, engine, serve, max_in_flight)
    finally:
        logger.info("shutting down the engine")
        engine.shutdown()
        thaw_heap()
        logger.info("stopped")
    return 0


def served_adapters(serve: ServeConfig) -> dict[str, str]:
    """name -> PEFT directory: those under every --lora-dir, then every --lora; a name given
    twice is a usage error."""
    from toppings.server.api.admin.lifecycle import discover

    try:
        found = [item for d in serve.lora_dirs for item in discover(d).items()]
    except ValueError as e:
        _usage_error(str(e))
    loras = dict(found + list(serve.loras))
    if len(loras) != len(found) + len(serve.loras):
        _usage_error("two adapters share a name (--lora and --lora-dir)")
    return loras


def load_engine(serve: ServeConfig, config: EngineConfig, loras: dict[str, str]) -> Engine:
    """The engine, built on a thread that ends (the process tuned for it first); a checkpoint
    or adapter it refuses is a usage error."""
    from toppings.cpu_lora.shm import SharedMemoryFull
    from toppings.gpu_lora.peft.config import AdapterError
    from toppings.server.model.loader import CheckpointError
    from toppings.server.process.allocator import bound_onednn_caches, tune_allocator
    from toppings.server.process.memory_probe import start_memory_probe
    from toppings.server.process.threads import (
        engine_thread_count,
        run_in_passing_thread,
        torch_on_this_thread_only,
    )
    from toppings.server.requests.request import RequestError
    from toppings.server.runtime import build_engine

    logger.info("loading %s with %d adapter(s), %s (cpu workers: %d)",
                serve.model, len(loras), config, config.num_cpu_workers)  # fmt: skip
    try:
        tune_allocator()
        bound_onednn_caches()  # before the model's first oneDNN op
        start_memory_probe()
        # One OpenMP team in the process, the engine's: the model is built on a thread that
        # ends, and this thread (waitress's loop from here) runs torch alone (threads.py).
        threads = engine_thread_count(config)  # before this thread's count becomes 1
        torch_on_this_thread_only()
        return run_in_passing_thread(build_engine, serve.model, config, loras, threads=threads)
    # An adapter that does not fit the model, a missing shard or tensor of its checkpoint.
    # /dev/shm full, or an adapter refused (its rank, its size, non-finite weights).
    except (AdapterError, CheckpointError, FileNotFoundError, SharedMemoryFull, RequestError) as e:
        _usage_error(str(e))


def serve_until_drained(app: Flask, engine: Engine, serve: ServeConfig, max_in_flight: int) -> None:
    """Serve `app` with waitress until a SIGTERM's drain (or a second signal) closes it."""
    sizing = waitress_settings(max_in_flight, serve.threads, serve.header_timeout)
    raise_open_files_limit(sizing["connection_limit"])
    made: list[GuardedServer] = []  # the waitress server, once it exists
    server_made = threading.Event()

    def stop_server() -> None:
        server_made.wait()  # signalled in the instant before waitress was made
        # The handlers write the last events of the requests that just ended, then waitress
        # closes every connection from its loop's thread and server.run() returns.
        made[0].stop(HANDLER_GRACE_S)

    draining = app.extensions["toppings"].draining
    drainer = Drainer(draining, engine.drain, serve.drain_timeout, stop_server, engine.abort_all)
    drainer.install_signals()
    try:
        server = GuardedServer(
            app,
            serve.header_timeout,
            host=serve.host,
            port=serve.port,
            channel_request_lookahead=1,  # lets waitress see a client hang up mid-stream
            **sizing,
        )
    except OSError as e:  # taken since the check above
        _usage_error(f"--port: {listen_error(serve.host, serve.port, e)}")
    made.append(server)
    server_made.set()
    url = f"http://{serve.host}:{server.effective_port}"
    logger.info("serving %s at %s (OpenAI base_url %s/v1); at most %d requests in flight, "
                "%d waitress threads", engine.model_name, url, url,
                max_in_flight, sizing["threads"])  # fmt: skip
    server.run()  # returns once the drain has closed waitress's sockets
    server.release()


if __name__ == "__main__":
    sys.exit(main())
