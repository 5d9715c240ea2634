"""Configuration precedence: defaults < file < environment < flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from common import config
from common.errors import ConfigError


def ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_arguments(p, config.RouterConfig)
    return p.parse_args(list(argv))


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('policy = "deflect-all"\nhttp_port = 9001\nalpha = 1.1\n')
    cfg = config.load(config.RouterConfig, args=ns("--config", str(f), "--alpha", "1.7"),
                      env={"KAIROS_HTTP_PORT": "9002", "KAIROS_LEDGER": "false"})
    assert cfg.policy == "deflect-all"  # file
    assert cfg.http_port == 9002        # env over file
    assert cfg.alpha == 1.7             # flag over file
    assert cfg.ledger is False          # env bool


def test_errors_are_clear(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("nonsense = 1\n")
    with pytest.raises(ConfigError, match="unknown option 'nonsense'"):
        config.load(config.RouterConfig, args=ns("--config", str(f)), env={})
    with pytest.raises(ConfigError, match="http_port"):
        config.load(config.RouterConfig, env={"KAIROS_HTTP_PORT": "eighty"})
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(config.RouterConfig, env={"KAIROS_CONFIG": str(tmp_path / "missing.toml")})


def test_to_env_round_trip() -> None:
    cfg = config.load(config.WorkerConfig, env={}, overrides={"worker_id": "decode-3", "time_scale": 0.5})
    env = config.to_env(cfg)
    assert env == {"KAIROS_WORKER_ID": "decode-3", "KAIROS_TIME_SCALE": "0.5"}
    assert config.load(config.WorkerConfig, env=env) == cfg


def test_each_option_says_its_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    """`kairos router --help` said `(default: X; env ...) (default: None)` (issue 48)."""
    with pytest.raises(SystemExit) as done:
        config.flags(["--help"], config.RouterConfig, "kairos router", "the router")
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: None)" not in text and not re.search(r"env KAIROS_\w+\) \(default", text)
    assert text.count("; env KAIROS_") == len(config.RouterConfig.__struct_fields__)
    assert "port of the OpenAI-compatible HTTP API (default: 8000; env KAIROS_HTTP_PORT)" in text


def test_a_wrongly_typed_value_names_its_key_its_source_and_the_type(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('alpha = "high"\n')
    with pytest.raises(ConfigError) as e:
        config.load(config.RouterConfig, args=ns("--config", str(f)), env={})
    assert e.value.event == "config_invalid"
    assert e.value.fields["key"] == "alpha" and e.value.fields["expected"] == "float"
    assert e.value.fields["source"] == f"alpha in {f}" and "float" in e.value.fix
    with pytest.raises(ConfigError, match="--http-port"):  # a flag's mistake, not argparse's usage text
        config.flags(["--http-port", "eighty"], config.RouterConfig, "kairos router", "the router")
