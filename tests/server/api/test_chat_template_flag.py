"""`--chat-template PATH` (server.chat_template.file): a Jinja file used instead of the
checkpoint's own template, read and compiled before the model loads; the rendered prompt is the
file's. A missing or malformed file, or anything but a regular file of bounded size (a /proc
file, a fifo, a link out of its directory), is one line and exit status 2."""

from __future__ import annotations

import os

import pytest

from tests.server.api.test_cli_errors import assert_refused, run
from toppings.server.api.app import create_app
from toppings.server.api.options import ApiOptions
from toppings.server.chat_template.file import MAX_TEMPLATE_BYTES, read_chat_template

MARKER = "MARKED-BY-THE-OPERATOR"
MARKED = (
    "{{ '" + MARKER + "\\n' }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello there"}]


def rendered(app) -> str:
    client = app.test_client()
    ids = client.post("/tokenize", json={"messages": MESSAGES}).get_json()["tokens"]
    return client.post("/detokenize", json={"tokens": ids}).get_json()["prompt"]


def test_the_template_file_changes_the_rendered_prompt(tiny_engine, tmp_path):
    path = tmp_path / "marked.jinja"
    path.write_text(MARKED)
    with tiny_engine() as engine:
        own = rendered(create_app(engine))
        app = create_app(engine, ApiOptions(chat_template=read_chat_template(str(path))))
        marked = rendered(app)
        # the chat route renders it too: the prompt grew by the marker's tokens
        body = {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
        usage = lambda a: a.test_client().post("/v1/chat/completions", json=body).get_json()  # noqa: E731
        assert (
            usage(app)["usage"]["prompt_tokens"]
            > usage(create_app(engine))["usage"]["prompt_tokens"]
        )
    assert MARKER not in own and "hello there" in own
    assert marked.startswith(MARKER) and marked.endswith(own.removeprefix(MARKER))


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("", "the file is empty"),
        ("{% for m in messages %}{{ m['content'] }}", "not a valid Jinja template: line 1"),
        (b"\xff\xfe\x00bad", "not UTF-8 text"),
    ],
)
def test_a_missing_or_bad_template_is_one_clear_line(tmp_path, content, message):
    path = tmp_path / "t.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        read_chat_template(str(path))
    assert str(info.value).startswith(f"--chat-template {path}:") and "\n" not in str(info.value)


def test_serve_refuses_a_bad_template_with_exit_2_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if x %}unclosed")
    # a model that does not exist: the template is checked first, so its line is the one given
    for path, words in ((tmp_path / "missing.jinja", ["no such file"]), (bad, ["Jinja"])):
        result = run("toppings-serve", "--model", str(tmp_path / "no-model"), "--port", "0",
                     "--chat-template", str(path))  # fmt: skip
        assert_refused(result, "toppings-serve", "--chat-template", str(path), *words)


def test_launch_checks_the_template_and_passes_it_to_every_server(tmp_path, tiny_model_dir):
    from toppings.scripts.launch.cli import parse_args
    from toppings.scripts.launch.plan import serve_command

    result = run("toppings-launch", "--model", str(tiny_model_dir),
                 "--chat-template", str(tmp_path / "missing.jinja"))  # fmt: skip
    assert_refused(result, "toppings-launch", "--chat-template", "no such file")
    good = tmp_path / "good.jinja"
    good.write_text(MARKED)
    args = parse_args(["--model", str(tiny_model_dir), "--chat-template", str(good)])

    class Server:
        port, num_workers, host_cores, device_cores = 8100, 1, (0,), ()

    cmd = serve_command(args, Server())
    assert cmd[cmd.index("--chat-template") + 1] == str(good.resolve())


def test_only_a_regular_file_of_bounded_size_is_read(tmp_path):
    fifo = tmp_path / "fifo.jinja"
    os.mkfifo(fifo)  # opening it must not wait for a writer
    big = tmp_path / "big.jinja"
    big.write_text("x" * (MAX_TEMPLATE_BYTES + 1))
    inside = tmp_path / "link.jinja"
    inside.symlink_to("marked.jinja")  # a link beside its target is the file it names
    (tmp_path / "marked.jinja").write_text(MARKED)
    assert read_chat_template(str(inside)) == MARKED
    cases = [(fifo, "not a regular file"), (big, "over"), ("/dev/zero", "under /dev"),
             ("/proc/self/environ", "under /proc"), ("/sys/kernel/mm", "under /sys")]  # fmt: skip
    for path, words in cases:
        with pytest.raises(ValueError, match=words) as info:
            read_chat_template(str(path))
        assert str(info.value).startswith(f"--chat-template {path}:")


def test_serve_refuses_proc_files_and_links_out_of_their_directory(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "passwd").write_text(MARKED)  # valid Jinja: only where it lies refuses it
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "chat.jinja").symlink_to(secret / "passwd")
    (templates / "up.jinja").symlink_to("../secret/passwd")
    cases = [("/proc/self/environ", "under /proc"),
             (str(templates / "chat.jinja"), "outside its directory"),
             (str(templates / "up.jinja"), "outside its directory")]  # fmt: skip
    for path, words in cases:
        result = run("toppings-serve", "--model", str(tmp_path / "no-model"), "--port", "0",
                     "--chat-template", path)  # fmt: skip
        assert_refused(result, "toppings-serve", f"--chat-template {path}:", words)
