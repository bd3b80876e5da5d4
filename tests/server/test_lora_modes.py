"""`--lora-mode auto`, the default: the mode measured best where the server runs."""

from __future__ import annotations

import pytest

from toppings.server.config import EngineConfig
from toppings.server.lora_modes import AUTO, LORA_MODES, pick_mode


def test_auto_is_cpu_assisted_on_a_cpu_and_on_demand_on_cuda():
    assert EngineConfig().lora_mode == AUTO
    assert pick_mode(AUTO, "cpu") == "cpu-assisted"
    assert pick_mode(AUTO, "cuda") == "on-demand"
    # host LoRA without workers on a device/host split would run on a device core
    assert pick_mode(AUTO, "cpu", split_without_workers=True) == "on-demand"


@pytest.mark.parametrize("name", list(LORA_MODES))
def test_a_named_mode_is_itself_everywhere(name):
    assert {pick_mode(name, d, s) for d in ("cpu", "cuda") for s in (False, True)} == {name}


def test_the_config_picks_by_its_own_split():
    assert EngineConfig().mode_on("cpu") == "cpu-assisted"
    assert EngineConfig(lora_mode="cached").mode_on("cpu") == "cached"
    split = EngineConfig(device_cores=(0,), cpu_cores=(1,))
    assert split.mode_on("cpu") == "on-demand"
    assert EngineConfig(device_cores=(0,), cpu_cores=(1,), num_cpu_workers=1).mode_on("cpu") == (
        "cpu-assisted"
    )
