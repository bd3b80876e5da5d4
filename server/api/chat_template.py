"""`--chat-template PATH`: a Jinja chat template used instead of the checkpoint's own, as vLLM's
and llama.cpp's `--chat-template` take it (for a checkpoint whose template lacks tools or a
system role, or renders them badly).

The file is read and compiled when the command line is parsed, before the model loads, so a
missing, unreadable or malformed template is one line and exit status 2. It compiles in the
sandboxed Jinja environment transformers renders chat templates in (with its loop controls);
the tokenizer copies that tokenize chat requests (server.api.tokenizer_pool) carry it.
"""

from __future__ import annotations

from pathlib import Path

MAX_TEMPLATE_BYTES = 1 << 20  # a chat template is kilobytes; this bounds a wrong path's read


def read_chat_template(path: str) -> str:
    """The template text of the file at `path`; raises ValueError (one line, naming the flag)
    when it is missing, unreadable, not UTF-8 text, empty or not valid Jinja."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    where = f"--chat-template {path}"
    file = Path(path).expanduser()
    try:
        if not file.is_file():
            raise ValueError(f"{where}: no such file")
        if file.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"{where}: over {MAX_TEMPLATE_BYTES} bytes: not a chat template")
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8 text") from None
    if not text.strip():
        raise ValueError(f"{where}: the file is empty")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])  # fmt: skip
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        problem = f"line {e.lineno}: {e.message}"
        raise ValueError(f"{where}: not a valid Jinja template: {problem}") from None
    return text
