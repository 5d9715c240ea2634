"""Every start-up mistake an operator makes is ONE JSON log line that says what to do, and a
non-zero exit (issue 48 item 3, issue 45 item 6): each test runs the real entry point as a
subprocess, with its output piped as a service log is, and checks that stdout holds exactly one
parseable line and stderr nothing. Each fails before the service's heavy work (no engine, no
bus), so the whole file takes a few seconds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, *args: str, env: dict[str, str] | None = None, pythonpath: str = "") -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    clean.update(env or {})
    if pythonpath:
        clean["PYTHONPATH"] = pythonpath + os.pathsep + clean.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=clean, capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode != 0, p.stdout
    assert p.stderr == "", p.stderr  # no traceback, no plain text
    lines = p.stdout.splitlines()
    assert len(lines) == 1, p.stdout
    line: dict[str, Any] = json.loads(lines[0])
    assert line["level"] == "error" and line["fix"] and line["error"] and line["timestamp"], line
    return line


def bus_args() -> list[str]:
    return ["--work-port", str(free_port()), "--telemetry-port", str(free_port()), "--metrics-port", "0"]


def test_router_port_in_use() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = run("services.router", "--http-port", str(port), *bus_args())
    assert line["event"] == "http_failed_to_start" and line["port"] == port and line["service"] == "router"
    assert "--http-port" in line["fix"]


@pytest.mark.parametrize("which", ["--work-port", "--telemetry-port"])
def test_router_bus_port_in_use(which: str) -> None:
    """The router's bus cannot bind: one bus_failed_to_start line (CI once got an AttributeError
    from the clean-up instead, which hid the bind error)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        other = "--telemetry-port" if which == "--work-port" else "--work-port"
        line = run("services.router", "--http-port", str(free_port()), which, str(port), other, str(free_port()),
                   "--metrics-port", "0")
    assert line["event"] == "bus_failed_to_start" and line["service"] == "router", line
    assert "Address already in use" in line["error"] and "--work-port" in line["fix"], line


def test_monitor_port_in_use() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = run("services.monitor", "--http-port", str(port), "--telemetry-port", str(free_port()))
    assert line["event"] == "http_failed_to_start" and line["port"] == port and line["service"] == "monitor"


def test_wrongly_typed_setting_names_the_key_and_the_type() -> None:
    line = run("services.router", *bus_args(), env={"KAIROS_HTTP_PORT": "eighty"})
    assert line["event"] == "config_invalid"
    assert (line["key"], line["expected"], line["source"]) == ("http_port", "int", "KAIROS_HTTP_PORT")
    line = run("services.decode_worker", "--token-budget", "many")
    assert line["event"] == "config_invalid" and "--token-budget" in line["error"]


def test_missing_model_directory(tmp_path: Path) -> None:
    line = run("services.decode_worker", "--engine", "vllm", "--model", str(tmp_path / "nowhere"))
    assert line["event"] == "model_not_found" and line["path"] == str(tmp_path / "nowhere")
    assert line["service"] == "decode_worker"
    line = run("services.router", *bus_args(), "--tokenizer", "meta-llama/not-a-directory")  # a wrong --model
    assert line["event"] == "model_not_found" and line["key"] == "tokenizer"


def test_vllm_not_installed(tmp_path: Path) -> None:
    """As on a host where vLLM's import fails (the issue's `No module named 'transformers'`)."""
    fake = tmp_path / "site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'transformers'\", "
                                               "name='transformers')\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    line = run("services.prefill_worker", "--engine", "vllm", "--model", str(model), pythonpath=str(fake))
    assert line["event"] == "engine_unavailable" and line["missing"] == "transformers"


@pytest.mark.parametrize("args,event", [(["--engine", "vllm", "--model", "/no/such/model"], "model_not_found"),
                                        (["--routers", "0"], "config_invalid")])
def test_kairos_up(args: list[str], event: str, tmp_path: Path) -> None:
    line = run("kairos.cli", "up", "--log-dir", str(tmp_path), *args)
    assert line["event"] == event and line["service"] == "up"


def test_kairos_up_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = run("kairos.cli", "up", "--log-dir", str(tmp_path), "--port", str(port))
    assert line["event"] == "http_failed_to_start" and line["port"] == port and line["service"] == "up"
    assert not (tmp_path / "router.log").exists()  # nothing was started
