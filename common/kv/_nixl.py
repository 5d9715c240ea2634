"""The only module that touches the `nixl` package: lazy import, agent creation, error mapping.

Nothing here runs at import time, so `common.kv` imports on lean installs without NIXL; the
first agent created raises KvUnavailable with the install recipe.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import Any

from common.kv.errors import KvBadDescriptor, KvError, KvNixlError, KvPeerLost, KvUnavailable, KvUnknownPeer

INSTALL_HINT = ("install NIXL 1.5.1 into this environment: `pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1` "
                "(see requirements/nixl.txt), or run with kv_transport=modeled")

_api: ModuleType | None = None
_import_error: str = ""


def _quiet_nixl_logging() -> None:
    """NIXL's Python logger prints INFO lines to stdout, where our JSON logs go: keep WARNING+ on stderr."""
    log = logging.getLogger("nixl")
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s NIXL %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False


def api() -> ModuleType:
    """The `nixl._api` module (or a backend wheel's `_api` without the meta package)."""
    global _api, _import_error
    if _api is not None:
        return _api
    errors = []
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            mod = importlib.import_module(name)
        except (ImportError, OSError) as e:  # OSError: a bundled shared library failed to load
            errors.append(f"{name}: {e}")
            continue
        _quiet_nixl_logging()
        _api = mod
        return mod
    _import_error = "; ".join(errors)
    raise KvUnavailable(f"kv_transport=nixl but NIXL cannot be imported ({_import_error}); {INSTALL_HINT}")


def available() -> bool:
    try:
        api()
    except KvUnavailable:
        return False
    return True


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return dist_version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def make_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend, progress thread and listener off (we drive progress)."""
    mod = api()
    cfg = mod.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
    try:
        agent = mod.nixl_agent(name, cfg)
    except Exception as e:
        raise KvUnavailable(f"cannot create NIXL agent {name!r}: {type(e).__name__}: {e}") from e
    if "UCX" not in agent.backends:
        raise KvUnavailable(f"NIXL agent {name!r} has no UCX backend (plugins: {agent.plugin_list})")
    return agent


def translate(exc: BaseException, what: str) -> KvError:
    """Map a NIXL exception (the classes share no base) to our typed error; `what` says what we did."""
    if isinstance(exc, KvError):
        return exc
    kind = type(exc).__name__
    text = f"{what}: {kind}: {exc}"
    if kind == "nixlRemoteDisconnectError":
        return KvPeerLost(text)
    if kind == "nixlNotFoundError" and "metadata for remote agent" in str(exc):
        return KvUnknownPeer(text)
    if kind in ("nixlInvalidParamError", "nixlNotFoundError", "nixlMismatchError", "nixlNotAllowedError",
                "TypeError", "ValueError", "KeyError"):
        return KvBadDescriptor(text)
    return KvNixlError(text)
