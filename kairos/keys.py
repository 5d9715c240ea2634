"""`kairos keys DIR`: CURVE key pairs for an authenticated, encrypted bus, one per worker id.

Writes DIR/router.key (public) and DIR/router.key_secret for the router (replicated routers: one
pair each with --routers router-a,router-b, so one router's secret key cannot pass for another),
one pair per worker id (default: the default cluster's prefill-0, prefill-1, decode-0, decode-1)
and per monitor name (default: monitor), and copies each client's public key into the allow-list
of its role:

    DIR/allowed/worker/   keys allowed on the router's work socket (heartbeats travel on it)
    DIR/allowed/monitor/  keys allowed on the router's telemetry socket

Each worker key records the one worker id it may register (`worker_id` in the key file), and the
router holds it to that: a Hello under another id is refused, and a registered worker's
connection takes no message signed with another key. A worker picks the key named after its id
(KAIROS_WORKER_ID) unless KAIROS_CURVE_KEY_NAME names another. A monitor's key cannot register
as a worker, nor a worker's read the telemetry. A client whose public key is not in its socket's
allow-list is refused at the handshake (and the router logs `bus_key_refused` with the key's
first 8 characters): it can neither send nor receive.

Point every service at the same DIR with KAIROS_CURVE_KEYS_DIR. On other hosts, a worker needs
router.key and its own <id>.key_secret, a monitor router.key and its own; keep allowed/ and
router.key_secret on the router hosts only. With routers of their own keys, each router takes
its pair with KAIROS_CURVE_KEY_NAME=<name>, and the workers and the monitor name each router's
public key in their router list (KAIROS_ROUTERS=host:5555:5556:router-a,...;
KAIROS_TELEMETRY=host:5557:router-a,...). A pool that grows: `kairos keys DIR --add --workers
decode-2`, then restart the routers (they read allowed/ at start).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
from pathlib import Path

import zmq

from common.sockets import MONITOR_DOMAIN, WORKER_DOMAIN, WORKER_ID_FIELD

DEFAULT_WORKERS = "prefill-0,prefill-1,decode-0,decode-1"
SHARED = "worker"  # the shared worker key of older releases: may register as any worker


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _write_pair(d: Path, name: str, metadata: dict[str, str]) -> None:
    """name.key and name.key_secret in ZeroMQ's certificate format (zmq.auth.load_certificate reads
    both), with the metadata in both files: the public one is what the router's allow-list holds."""
    public, secret = zmq.curve_keypair()
    meta = "".join(f"    {k} = \"{v}\"\n" for k, v in metadata.items())
    made = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    head = f"#   made by `kairos keys` on {made}\n#   ZeroMQ CURVE certificate ({name})\n\nmetadata\n{meta}curve\n"
    (d / f"{name}.key").write_text(f"{head}    public-key = \"{public.decode()}\"\n", encoding="utf-8")
    sec = d / f"{name}.key_secret"
    sec.write_text(f"{head}    public-key = \"{public.decode()}\"\n    secret-key = \"{secret.decode()}\"\n",
                   encoding="utf-8")
    sec.chmod(0o600)


def write_keys(d: Path, roles: dict[str, list[str]], *, routers: tuple[str, ...] = ("router",),
               shared_worker_key: bool = False) -> list[str]:
    """Create a key pair for each router and client name DIR does not have yet (worker keys bound
    to their name as worker id), and the allow-lists by role. Returns the names made."""
    d.mkdir(parents=True, exist_ok=True)
    made = []
    for name in routers:
        if not (d / f"{name}.key_secret").exists():
            _write_pair(d, name, {"role": "router"})
            made.append(name)
    wanted = [(role, name, {"role": role, **({WORKER_ID_FIELD: name} if role == WORKER_DOMAIN else {})})
              for role, names in roles.items() for name in names]
    if shared_worker_key:
        wanted.append((WORKER_DOMAIN, SHARED, {"role": WORKER_DOMAIN}))
    for role, name, meta in wanted:
        allowed = d / "allowed" / role
        allowed.mkdir(parents=True, exist_ok=True)
        if not (d / f"{name}.key_secret").exists():
            _write_pair(d, name, meta)
            made.append(name)
        if not (allowed / f"{name}.key").exists():
            shutil.copy(d / f"{name}.key", allowed / f"{name}.key")
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kairos keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="directory to write the keys to (created if missing)")
    p.add_argument("--workers", default=DEFAULT_WORKERS,
                   help=f"comma-separated worker ids, one key each, bound to that id (default: {DEFAULT_WORKERS})")
    p.add_argument("--monitors", default="monitor", help="comma-separated key names for monitors (default: monitor)")
    p.add_argument("--routers", default="router",
                   help="comma-separated key names for routers (default: router, one pair for the router or shared "
                        "by replicas; router-a,router-b: one each)")
    p.add_argument("--shared-worker-key", action="store_true",
                   help=f"also make one key {SHARED!r} that may register as ANY worker (fleets whose ids are not "
                        "known in advance; a holder of it can take any free id: the router warns at start)")
    p.add_argument("--add", action="store_true",
                   help="add keys for the names given that DIR does not have yet, keeping every existing key "
                        "(a pool that grows); restart the routers afterwards")
    p.add_argument("--force", action="store_true",
                   help="replace every key in DIR (every service must then get the new ones)")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing (exit 0) if DIR already has keys: for an init container run at every start")
    a = p.parse_args(argv)
    d = Path(a.dir)
    roles = {WORKER_DOMAIN: _names(a.workers), MONITOR_DOMAIN: _names(a.monitors)}
    routers = tuple(_names(a.routers))
    names = [*routers, *roles[WORKER_DOMAIN], *roles[MONITOR_DOMAIN], *([SHARED] if a.shared_worker_key else [])]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash or not routers:
        print(f"error: a key name has one role and one key: {clash or 'no router'} given twice", file=sys.stderr)
        return 2
    had = any(d.glob("*.key_secret"))
    if had and not (a.force or a.add):
        if a.if_missing:
            print(f"{d} already has keys; left as they are")
            return 0
        print(f"error: {d} already has keys; use --add to add keys for new names, or --force to replace them all "
              "(every service must then get the new ones)", file=sys.stderr)
        return 1
    if a.force:
        for f in [*d.glob("*.key"), *d.glob("*.key_secret")]:
            f.unlink()
        if (d / "allowed").exists():
            shutil.rmtree(d / "allowed")  # the old allow-lists must not outlive their keys
    made = write_keys(d, roles, routers=routers, shared_worker_key=a.shared_worker_key)
    summary = "; ".join(f"{role}: {', '.join(n)}" for role, n in roles.items() if n)
    if a.add:
        print(f"added CURVE keys to {d}: {', '.join(made) or 'none (all there already)'}; restart the routers "
              "to allow them")
    else:
        print(f"wrote CURVE keys to {d}: {', '.join(routers)} + {summary}"
              f"{' + shared worker key' if a.shared_worker_key else ''}; "
              f"allow-lists in {d / 'allowed'}/<role>/")
    print(f"use them with: KAIROS_CURVE_KEYS_DIR={d} (each worker takes the key named after its KAIROS_WORKER_ID)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
