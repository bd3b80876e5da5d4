"""`--lora-resolver` is refused before the model loads: an unknown kind by argparse, a missing
directory by the settings' check."""

from __future__ import annotations

import pytest

from toppings.server.api.options import ApiOptions
from toppings.server.cli_args import build_parser, parse_configs


def test_the_flags_reach_the_api_options(tmp_path):
    args = build_parser().parse_args(["--model", "m", "--lora-resolver", f"dir:{tmp_path}",
                                      "--lora-resolver-max-adapters", "3"])  # fmt: skip
    _, _, options = parse_configs(args)
    assert options.lora_resolver == f"dir:{tmp_path}"
    assert (options.lora_resolver_max_adapters, options.lora_resolver_max_loading) == (3, 4)


@pytest.mark.parametrize("spec", ["s3:bucket", "dir:", "nokind"])
def test_an_unknown_kind_is_a_usage_error(spec, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--lora-resolver", spec])
    assert "--lora-resolver wants KIND:ARG with KIND one of dir:..." in capsys.readouterr().err


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        ApiOptions(lora_resolver=f"dir:{tmp_path / 'absent'}")
    with pytest.raises(ValueError, match="positive"):
        ApiOptions(lora_resolver=f"dir:{tmp_path}", lora_resolver_max_adapters=0)
