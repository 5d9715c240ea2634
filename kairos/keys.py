"""`kairos keys DIR`: CURVE key pairs for an authenticated, encrypted bus, labelled by role.

Writes DIR/router.key (public) and DIR/router.key_secret for the router, one pair per client
key (default: `worker` for the workers, `monitor` for the monitor; each key file records its
role), and copies each client's public key into the allow-list of its role:

    DIR/allowed/worker/   keys allowed on the router's work socket (heartbeats travel on it)
    DIR/allowed/monitor/  keys allowed on the router's telemetry socket

so a monitor's key cannot register as a worker, nor a worker's read the telemetry. Point every
service at the same DIR with KAIROS_CURVE_KEYS_DIR (on other hosts: copy router.key and the
client's own *.key_secret; keep allowed/ on the router host only). A client whose public key is
not in its socket's allow-list is refused at the handshake: it can neither send nor receive.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import zmq.auth

from common.sockets import MONITOR_DOMAIN, WORKER_DOMAIN


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def write_keys(d: Path, roles: dict[str, list[str]]) -> None:
    """Create the router's key pair and one per client name, and the allow-lists by role."""
    d.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(d), "router", metadata={"role": "router"})
    for role, names in roles.items():
        allowed = d / "allowed" / role
        allowed.mkdir(parents=True, exist_ok=True)
        for name in names:
            zmq.auth.create_certificates(str(d), name, metadata={"role": role})
            shutil.copy(d / f"{name}.key", allowed / f"{name}.key")
    for f in d.glob("*.key_secret"):
        f.chmod(0o600)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kairos keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="directory to write the keys to (created if missing)")
    p.add_argument("--workers", default="worker",
                   help="comma-separated key names for workers (default: worker; one shared by every worker)")
    p.add_argument("--monitors", default="monitor", help="comma-separated key names for monitors (default: monitor)")
    p.add_argument("--force", action="store_true", help="overwrite existing keys")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing (exit 0) if DIR already has keys: for an init container run at every start")
    a = p.parse_args(argv)
    d = Path(a.dir)
    roles = {WORKER_DOMAIN: _names(a.workers), MONITOR_DOMAIN: _names(a.monitors)}
    clash = set(roles[WORKER_DOMAIN]) & set(roles[MONITOR_DOMAIN])
    if clash or "router" in roles[WORKER_DOMAIN] + roles[MONITOR_DOMAIN]:
        print(f"error: a key name has one role: {sorted(clash) or ['router']} given twice", file=sys.stderr)
        return 2
    if (d / "router.key").exists() and not a.force:
        if a.if_missing:
            print(f"{d} already has keys; left as they are")
            return 0
        print(f"error: {d} already has keys; use --force to replace them (every service must then get the new ones)",
              file=sys.stderr)
        return 1
    if a.force and (d / "allowed").exists():
        shutil.rmtree(d / "allowed")  # the old allow-lists must not outlive their keys
    write_keys(d, roles)
    summary = "; ".join(f"{role}: {', '.join(names)}" for role, names in roles.items())
    print(f"wrote CURVE keys to {d}: router + {summary}; allow-lists in {d / 'allowed'}/<role>/")
    print(f"use them with: KAIROS_CURVE_KEYS_DIR={d} (and KAIROS_CURVE_KEY_NAME=<name> for other key names)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
