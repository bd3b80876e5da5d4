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
    message = str(exit_info.value.code)
    assert f"{flag}: port {taken_port} on 127.0.0.1 is already in use" in message
    assert other + ":" not in message  # the free one is not named
    assert "Preparing" not in capsys.readouterr().out


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
