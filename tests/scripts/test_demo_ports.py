"""`toppings-demo` checks its ports before it prepares anything, says "the first time" only the
first time, and suggests greedy calls."""

from __future__ import annotations

import json

import pytest

from toppings.scripts import demo


@pytest.mark.parametrize("flag", ["--port", "--server-port"])
def test_a_taken_port_stops_the_demo_before_the_model_is_prepared(
    flag, taken_port, free_port, monkeypatch, capsys
):
    def prepare(*args, **kwargs):
        raise AssertionError("the demo prepared its adapters and model before the port check")

    monkeypatch.setattr(demo, "demo_adapters", prepare)
    other = "--server-port" if flag == "--port" else "--port"
    with pytest.raises(SystemExit) as exit_info:
        demo.main([flag, str(taken_port), other, str(free_port())])
    assert exit_info.value.code == 2  # as toppings-serve and toppings-launch exit for it
    out = capsys.readouterr()
    (message,) = out.err.splitlines()
    assert message.startswith("toppings-demo: error: ")
    assert f"{flag}: port {taken_port} on 127.0.0.1 is already in use" in message
    assert other + ":" not in message  # the free one is not named
    assert "Preparing" not in out.out


def test_a_bad_chat_template_stops_the_demo_with_exit_2(tmp_path, free_port, monkeypatch, capsys):
    monkeypatch.setattr(demo, "demo_adapters", lambda *a: pytest.fail("prepared adapters"))
    missing = tmp_path / "missing.jinja"
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--port", str(free_port()), "--server-port", str(free_port()),
                   "--chat-template", str(missing)])  # fmt: skip
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"toppings-demo: error: --chat-template {missing}: no such file"
    )


def test_help_imports_nothing_heavy_and_documents_every_flag():
    import subprocess
    import sys

    code = ("import sys; from toppings.scripts import demo\n"
            "try:\n    demo.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'requests', 'toppings.server.cli') "
            "if m in sys.modules]\nprint('HEAVY', heavy)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "HEAVY []" in out, out
    flags = [a for a in demo.build_parser()._actions if a.dest != "help"]
    assert {a.option_strings[0] for a in flags} >= {"--port", "--server-port", "--device"}
    assert all(a.help for a in flags), [a.dest for a in flags if not a.help]


def test_the_stopping_line_says_what_it_waits_for():
    assert "in flight" not in demo.stopping_line(0)
    assert "in flight" not in demo.stopping_line(None)
    line = demo.stopping_line(2)
    assert "2 requests in flight" in line and f"at most {demo.STOP_GRACE_S:.0f} s" in line
    assert "Ctrl-C again" in line and "1 request in flight" in demo.stopping_line(1)


def test_first_time_line_only_the_first_time(tmp_path):
    assert "the first time" in demo.preparing_line(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    line = demo.preparing_line(tmp_path)
    assert "the first time" not in line and str(tmp_path) in line


def test_suggested_calls_are_greedy():
    text = demo.instructions("http://127.0.0.1:8000", "base")
    bodies = [json.loads(line.strip()[4:-1]) for line in text.splitlines()
              if line.strip().startswith("-d '")]  # fmt: skip
    assert len(bodies) == 2
    assert all(body["temperature"] == 0 for body in bodies)
