"""bench/token_path.py (both ways) and bench/request_path.py run and say what they measured."""

from __future__ import annotations

import pytest

from bench import token_path


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts configure structlog to print to stdout, which here is this test's capture
    (closed after it): later tests' log lines would fail. The tests keep the logging as it is."""
    monkeypatch.setattr(token_path.logs, "configure", lambda *a, **k: None)


@pytest.mark.parametrize("direct", ["on", "off"])
def test_token_path_measures_both_endpoints(direct: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert token_path.main(["--streams", "2", "--tokens", "3", "--repeat", "1", "--direct", direct]) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if "per token" in line]  # not log lines
    assert [line.split(":")[0] for line in out] == ["chat", "completions"]
    assert all("µs of CPU per token" in line and f"direct {direct}" in line for line in out)


@pytest.mark.parametrize("tokenizer", ["simple", "bytes"])
@pytest.mark.parametrize("text", ["on", "off"])
def test_token_path_with_and_without_the_workers_text(tokenizer: str, text: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert token_path.main(["--streams", "2", "--tokens", "40", "--repeat", "1", "--worker-text", text,
                            "--tokenizer", tokenizer]) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if "per token" in line]
    assert len(out) == 2 and all(f"worker text {text}, tokenizer {tokenizer}" in line for line in out)


def test_request_path_times_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import request_path

    assert request_path.main(["--requests", "3", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert all(stage in out for stage in request_path.STAGES) and "total" in out


def test_decode_admit_times_admitted_deflections(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import decode_admit

    monkeypatch.setattr(decode_admit.logs, "configure", lambda *a, **k: None)
    assert decode_admit.main(["--requests", "5", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "DecodeWork handled:" in out and "µs wall" in out and "5 x 128-token deflections x 1 runs" in out
