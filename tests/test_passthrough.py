"""`kairos up` passes the operator's KAIROS_* environment and a --config file to the services that
have each setting (kairos/passthrough.py), as compose does; what kairos up sets itself wins, and
says so."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from common.errors import ConfigError
from common.ports import free_ports
from kairos.passthrough import passthrough
from kairos.up import Cluster, parser, spec_from_args


def test_each_setting_reaches_the_services_that_have_it(tmp_path: Path) -> None:
    f = tmp_path / "kairos.toml"
    f.write_text('tool_call_parser = "hermes"\nlog_level = "debug"\n'
                 "[worker]\nvllm_kv_cache_mib = 64\n[decode]\ndrain_timeout = 5.0\n[router]\ncandidates = [512, 256]\n")
    env = {"KAIROS_ENABLE_AUTO_TOOL_CHOICE": "true", "KAIROS_VLLM_KV_CACHE_MIB": "128", "PATH": "/bin",
           "KAIROS_NO_SUCH_THING": "1", "KAIROS_CONFIG": "/elsewhere.toml"}
    roles, notes = passthrough(str(f), env)
    assert roles["router"]["KAIROS_TOOL_CALL_PARSER"] == "hermes"
    assert roles["router"]["KAIROS_ENABLE_AUTO_TOOL_CHOICE"] == "true"
    assert roles["router"]["KAIROS_CANDIDATES"] == "512,256"
    assert "KAIROS_TOOL_CALL_PARSER" not in roles["decode"]  # a router setting stays with the routers
    # the environment beats the file
    assert roles["prefill"]["KAIROS_VLLM_KV_CACHE_MIB"] == roles["decode"]["KAIROS_VLLM_KV_CACHE_MIB"] == "128"
    assert roles["decode"]["KAIROS_DRAIN_TIMEOUT"] == "5.0" and "KAIROS_DRAIN_TIMEOUT" not in roles["prefill"]
    assert all(r["KAIROS_LOG_LEVEL"] == "debug" for r in roles.values())  # every service has it
    assert "PATH" not in roles["router"]
    assert any("KAIROS_NO_SUCH_THING" in n for n in notes) and any("--config" in n for n in notes)


@pytest.mark.parametrize("text, what", [("no_such_option = 1\n", "no_such_option"),
                                        ("[gpu]\nx = 1\n", "[gpu]"),
                                        ("[worker]\ntool_call_parser = 'hermes'\n", "tool_call_parser"),
                                        ("not toml = = 1\n", "TOML")])
def test_a_bad_config_file_stops_the_start_naming_the_option(tmp_path: Path, text: str, what: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=what.replace("[", r"\[").replace("]", r"\]")):
        passthrough(str(f), {})


def test_kairos_up_builds_the_services_with_them_and_keeps_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAIROS_TOOL_CALL_PARSER", "hermes")
    monkeypatch.setenv("KAIROS_WORK_PORT", "1")        # kairos up's wiring: its value wins
    monkeypatch.setenv("KAIROS_ALPHA", "2.0")          # a knob kairos up sets from its own flags
    spec = spec_from_args(parser().parse_args(["--no-monitor"]))
    c = Cluster(spec)
    assert c.services["router"].env["KAIROS_TOOL_CALL_PARSER"] == "hermes"
    assert "KAIROS_TOOL_CALL_PARSER" not in c.services["decode-0"].env
    assert c.services["router"].env["KAIROS_WORK_PORT"] == str(spec.work_port) != "1"
    assert {"KAIROS_WORK_PORT", "KAIROS_ALPHA"} <= set(c.overridden)
    assert "KAIROS_TOOL_CALL_PARSER" not in c.overridden
    # given as its flag, the knob is kairos up's, with no complaint
    monkeypatch.delenv("KAIROS_ALPHA")
    c = Cluster(spec_from_args(parser().parse_args(["--no-monitor", "--alpha", "2.0"])))
    assert c.services["router"].env["KAIROS_ALPHA"] == "2.0" and "KAIROS_ALPHA" not in c.overridden


def test_a_live_cluster_runs_with_the_config_file_and_the_environment(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "kairos.toml"
    f.write_text("[router]\ndefault_max_tokens = 3\nserved_model_name = \"from-the-file\"\n")
    monkeypatch.setenv("KAIROS_SERVED_MODEL_NAME", "from-the-env")  # the environment beats the file
    http, bus, mon = free_ports(3)
    while len({bus, bus + 1, bus + 2, http, mon}) < 5:
        http, bus, mon = free_ports(3)
    a = parser().parse_args(["--config", str(f), "--prefill", "1", "--decode", "1", "--no-monitor",
                             "--kv-transport", "modeled", "--port", str(http), "--bus-port", str(bus),
                             "--monitor-port", str(mon), "--log-dir", str(tmp_path / "logs")])
    with Cluster(spec_from_args(a)) as c:
        models = httpx.get(c.spec.api + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["from-the-env"]
        r = httpx.post(c.spec.api + "/v1/chat/completions", timeout=30,
                       json={"model": "from-the-env", "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3  # the file's default_max_tokens
