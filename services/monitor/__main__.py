"""`python -m services.monitor` / `kairos monitor`."""

from __future__ import annotations

import sys

from common import config, logging
from common.service import run
from common.startup import guard
from services.monitor.service import Monitor


def main(argv: list[str] | None = None) -> int:
    return guard("monitor", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg = config.flags(argv, config.MonitorConfig, "kairos monitor",
                       "Kairos monitor: subscribes to the router's telemetry; serves /metrics and the dashboard.")

    async def serve_it() -> int:
        logging.configure("monitor", level=cfg.log_level, fmt=cfg.log_format)
        return await Monitor(cfg).run()

    return run(serve_it)


if __name__ == "__main__":
    sys.exit(main())
