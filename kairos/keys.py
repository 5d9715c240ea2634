"""`kairos keys DIR`: CURVE key pairs for an authenticated, encrypted bus.

Writes DIR/router.key (public) and DIR/router.key_secret for the router, one pair per client
name (default: worker, monitor), and copies the clients' public keys into DIR/allowed/, the
allow-list the router checks every connection against. Point every service at the same DIR with
KAIROS_CURVE_KEYS_DIR (on other hosts: copy router.key, the client's own *.key_secret, and keep
allowed/ on the router host only). A client whose public key is not in allowed/ is refused at the
handshake: it can neither send nor receive anything.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import zmq.auth


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kairos keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="directory to write the keys to (created if missing)")
    p.add_argument("--clients", default="worker,monitor",
                   help="comma-separated client key names to create (default: worker,monitor)")
    p.add_argument("--force", action="store_true", help="overwrite existing keys")
    a = p.parse_args(argv)
    d = Path(a.dir)
    allowed = d / "allowed"
    if (d / "router.key").exists() and not a.force:
        print(f"error: {d} already has keys; use --force to replace them (every service must then get the new ones)",
              file=sys.stderr)
        return 1
    allowed.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(d), "router")
    names = [n.strip() for n in a.clients.split(",") if n.strip()]
    for name in names:
        zmq.auth.create_certificates(str(d), name)
        shutil.copy(d / f"{name}.key", allowed / f"{name}.key")
    for f in d.glob("*.key_secret"):
        f.chmod(0o600)
    print(f"wrote CURVE keys to {d}: router + {', '.join(names)}; allow-list in {allowed}/")
    print(f"use them with: KAIROS_CURVE_KEYS_DIR={d} (and KAIROS_CURVE_KEY_NAME=<client> for other client names)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
