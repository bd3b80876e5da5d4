"""`toppings-serve`: build one engine from the command line and serve its HTTP API with waitress."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import waitress

from server.config import DEVICES, DTYPES, KERNELS, LORA_MODES, EngineConfig

logger = logging.getLogger("toppings-serve")


def _lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="toppings-serve",
        description="Serve one base model and many LoRA adapters over an OpenAI-compatible API.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face checkpoint directory, .gguf file, or the alias smollm2",
    )
    p.add_argument(
        "--lora",
        action="append",
        type=_lora,
        default=[],
        metavar="NAME=PATH",
        help="a PEFT adapter directory served as model NAME (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument(
        "--dtype", choices=DTYPES, default=None, help="default: bfloat16 on cuda, float32 on cpu"
    )
    p.add_argument(
        "--lora-mode",
        choices=LORA_MODES,
        default="cached",
        help="how a request whose adapter is not on the device starts",
    )
    p.add_argument("--kernel", choices=KERNELS, default="mbgmv")
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=0,
        metavar="N",
        help="CPU worker processes for cpu-assisted LoRA; accepted and recorded, "
        "not used by the engine yet",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=32768,
        help="KV cache size in tokens over all requests",
    )
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=16, help="waitress handler threads")
    p.add_argument("--log-level", default="INFO")
    return p


def _raise_interrupt(signum: int, frame) -> None:
    """First SIGINT/SIGTERM: stop waitress, then the engine. A second one kills at once."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.cpu_workers < 0:
        sys.exit("toppings-serve: --cpu-workers must be >= 0")
    try:
        config = EngineConfig(
            device=args.device,
            dtype=args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
            kernel=args.kernel,
            lora_mode=args.lora_mode,
            max_total_tokens=args.max_total_tokens,
            max_batch_size=args.max_batch_size,
        )
    except ValueError as e:
        sys.exit(f"toppings-serve: {e}")
    loras = dict(args.lora)
    if len(loras) != len(args.lora):
        sys.exit("toppings-serve: two --lora options share a name")

    # Imported here so that `--help` answers without loading torch.
    from server.api import create_app
    from server.runtime import build_engine

    logger.info(
        "loading %s with %d adapter(s), %s (cpu workers: %d)",
        args.model,
        len(loras),
        config,
        args.cpu_workers,
    )
    engine = build_engine(args.model, config, loras)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupt)
    try:
        server = waitress.create_server(
            create_app(engine),
            host=args.host,
            port=args.port,
            threads=args.threads,
            channel_request_lookahead=1,  # lets waitress see a client hang up mid-stream
        )
        url = f"http://{args.host}:{server.effective_port}"
        logger.info("serving %s at %s (OpenAI base_url %s/v1)", engine.model_name, url, url)
        server.run()  # returns on SIGINT/SIGTERM, once waitress has closed its sockets
    finally:
        logger.info("shutting down the engine")
        engine.shutdown()
        logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
