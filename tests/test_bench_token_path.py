"""bench/token_path.py (both ways) and bench/request_path.py run and say what they measured."""

from __future__ import annotations

import pytest

from bench import token_path


@pytest.mark.parametrize("direct", ["on", "off"])
def test_token_path_measures_both_endpoints(direct: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert token_path.main(["--streams", "2", "--tokens", "3", "--repeat", "1", "--direct", direct]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["chat", "completions"]
    assert all("µs of CPU per token" in line and f"direct {direct}" in line for line in out)


def test_request_path_times_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import request_path

    assert request_path.main(["--requests", "3", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert all(stage in out for stage in request_path.STAGES) and "total" in out
