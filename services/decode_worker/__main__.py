"""`python -m services.decode_worker` / `kairos decode-worker`."""

from __future__ import annotations

import sys

from common import config, logging
from common.service import run
from common.startup import guard
from common.worker_metrics import run_with_metrics
from services.roles import RoleSwitching


def main(argv: list[str] | None = None) -> int:
    return guard("decode_worker", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg = config.flags(argv, config.WorkerConfig, "kairos decode-worker",
                       "Kairos decode worker: decodes handed-off requests, prefills deflected ones in place, "
                       "publishes TBT-slack heartbeats. "
                       "Connects to the router; needs no other address.")

    async def serve_it() -> int:
        logging.configure("decode_worker", level=cfg.log_level, fmt=cfg.log_format)
        return await run_with_metrics(cfg, RoleSwitching(cfg, "decode"))  # it follows SetRole

    return run(serve_it)


if __name__ == "__main__":
    sys.exit(main())
