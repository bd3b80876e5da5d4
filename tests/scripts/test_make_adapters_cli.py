"""`python -m toppings.scripts.make_adapters --base MODEL`: MODEL as toppings-serve takes it,
a local path never read as a Hugging Face hub id."""

from __future__ import annotations

import json
import subprocess
import sys

from toppings.scripts.make_adapters import main


def test_missing_base_is_one_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    cmd = [sys.executable, "-m", "toppings.scripts.make_adapters", "--base", str(missing),
           "--out", str(tmp_path / "loras"), "--ranks", "8"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Repo id" not in result.stderr, result.stderr
    assert str(missing) in result.stderr
    assert not (tmp_path / "loras").exists()


def test_tiny_model_dir(tiny_model_dir, tmp_path, capsys):
    main(["--base", str(tiny_model_dir), "--out", str(tmp_path), "--ranks", "4,8",
          "--targets", "q_proj,o_proj"])  # fmt: skip
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "lora-r4-0"), str(tmp_path / "lora-r8-0")]
    config = json.loads((tmp_path / "lora-r8-0" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["o_proj", "q_proj"]
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
