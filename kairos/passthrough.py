"""What an operator gives `kairos up`'s services beyond its flags: the KAIROS_* variables of its
environment and a `--config FILE`, passed to every service that has the setting, as compose passes
a service's environment.

The file is TOML (or JSON). Top-level keys go to every service that has the field; tables
`[router]`, `[monitor]`, `[worker]` (both pools), `[prefill]` and `[decode]` go to those only:

    tool_call_parser = "hermes"     # the router's (kairos router --help)
    [worker]
    vllm_kv_cache_mib = 64          # every worker's (kairos decode-worker --help)

The environment beats the file, as in every service (common/config.py). What `kairos up` sets
itself (bus ports, worker ids, the policy and the settings of its own flags) beats both: the
caller warns about each such setting, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.config import ENV_PREFIX, MonitorConfig, RouterConfig, WorkerConfig, _read_file, env_text
from common.errors import ConfigError

ROLES: dict[str, type[Any]] = {"router": RouterConfig, "monitor": MonitorConfig, "prefill": WorkerConfig,
                               "decode": WorkerConfig}
COMMAND = {"router": "router", "monitor": "monitor", "prefill": "prefill-worker", "decode": "decode-worker"}
TABLES = {"router": ("router",), "monitor": ("monitor",), "worker": ("prefill", "decode"), "prefill": ("prefill",),
          "decode": ("decode",)}


def _roles(name: str) -> list[str]:
    return [r for r, cls in ROLES.items() if name in cls.__struct_fields__]


def passthrough(config_file: str | None, environ: Mapping[str, str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Per role (router, monitor, prefill, decode), the KAIROS_* environment the operator gave;
    and notes on what was ignored. A file key no service has is an error (a typo stops the start);
    an environment variable no service has is only noted (the shell may hold others)."""
    out: dict[str, dict[str, str]] = {r: {} for r in ROLES}
    notes: list[str] = []
    if config_file:
        data = _read_file(config_file)
        for key, value in data.items():
            if isinstance(value, dict):
                if key not in TABLES:
                    raise ConfigError(f"config file {config_file}: unknown table [{key}] "
                                      f"(known: {', '.join(f'[{t}]' for t in TABLES)})")
                for k, v in value.items():
                    cls = ROLES[TABLES[key][0]]
                    if k not in cls.__struct_fields__:
                        raise ConfigError(f"config file {config_file}: [{key}] has no option {k!r} "
                                          f"(`kairos {COMMAND[TABLES[key][0]]} --help` lists them)")
                    for r in TABLES[key]:
                        out[r][ENV_PREFIX + k.upper()] = env_text(v)
                continue
            roles = _roles(key)
            if not roles or key == "config":
                raise ConfigError(f"config file {config_file}: no service has an option {key!r} "
                                  "(`kairos router --help`, `kairos decode-worker --help` list them)")
            for r in roles:
                out[r][ENV_PREFIX + key.upper()] = env_text(value)
    for var, value in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name == "config":
            notes.append(f"{var} is not passed on: give the file to kairos up as --config")
            continue
        roles = _roles(name)
        if not roles:
            notes.append(f"{var} is not a setting of any service: ignored")
            continue
        for r in roles:
            out[r][var] = value
    return out, notes
