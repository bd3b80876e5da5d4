"""`toppings-serve`'s command line, generated from the settings classes (server.settings).

One argparse group per class: the command's own `ServeConfig` (model, adapters, logging, and
the HTTP front's listening and draining, server.http.listen), the HTTP layer's `ApiOptions`,
and the four parts of `EngineConfig`.
`parse_configs` builds the three objects from what argparse returned; each is validated as it
is built, before anything loads (a `--chat-template` file is read and compiled there too).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from toppings.server.api.options import ApiOptions
from toppings.server.chat_template.file import read_chat_template
from toppings.server.config import ENGINE_PARTS, EngineConfig
from toppings.server.http.listen import ListenSettings
from toppings.server.settings import (
    Flag,
    Settings,
    build,
    command_parser,
    log_level,
    name_path,
    setting,
)


@dataclass(frozen=True, kw_only=True)
class ServeConfig(ListenSettings):
    """What to serve, where to listen (the front's flags, shared with the scheduler), how to
    stop."""

    title = "server"

    model: str = setting(
        flag=Flag("Hugging Face checkpoint directory, .gguf file, or the alias smollm2")
    )
    loras: tuple[tuple[str, str], ...] = setting(
        (),
        flag=Flag(
            "a PEFT adapter directory served as model NAME (repeatable)",
            name="--lora",
            type=name_path,
            metavar="NAME=PATH",
            action="append",
            parse=tuple,
        ),
    )
    lora_dirs: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "serve every PEFT adapter directory under DIR, named after its folder; "
            "/v1/load_lora_adapter may load from DIR too (repeatable)",
            name="--lora-dir",
            metavar="DIR",
            action="append",
            parse=tuple,
        ),
    )
    allowed_lora_roots: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "/v1/load_lora_adapter may load adapters from under DIR (repeatable); with "
            "neither this nor --lora-dir, loading at run time is disabled",
            name="--allowed-lora-root",
            metavar="DIR",
            action="append",
            parse=tuple,
        ),
    )
    chat_template: str | None = setting(
        None,
        flag=Flag(
            "a Jinja chat template file used instead of the checkpoint's own (e.g. one that "
            "renders tools or a system role); a regular file of at most 1 MiB (nothing under "
            "/proc, /sys or /dev, no link out of its directory), checked before the model loads",
            metavar="PATH",
        ),
    )
    log_level: str = setting("INFO", flag=Flag("DEBUG, INFO, WARNING or ERROR", type=log_level))


# Every settings class whose fields are flags of toppings-serve, in --help's order (the flag
# reference, docs/flags.md, is generated from them: toppings.scripts.flag_reference).
SETTINGS_CLASSES: tuple[type[Settings], ...] = (ServeConfig, ApiOptions, *ENGINE_PARTS)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `toppings-serve`: every flag of every settings class, grouped by class."""
    return command_parser(
        "toppings-serve",
        "Serve one base model and many LoRA adapters over an OpenAI-compatible API.",
        SETTINGS_CLASSES,
    )


def parse_configs(args: argparse.Namespace) -> tuple[ServeConfig, EngineConfig, ApiOptions]:
    """The command's, the engine's and the HTTP layer's settings from the parsed flags; raises
    ValueError naming the first field out of its range."""
    serve = build(ServeConfig, args)
    engine = build(EngineConfig, args)
    template = None if serve.chat_template is None else read_chat_template(serve.chat_template)
    options = build(ApiOptions, args, lora_roots=serve.lora_dirs + serve.allowed_lora_roots,
                    chat_template=template)  # fmt: skip
    return serve, engine, options
