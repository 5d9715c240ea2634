"""`python -m services.prefill_worker` / `kairos prefill-worker`."""

from __future__ import annotations

import sys

from common import config, logging
from common.service import run
from common.startup import guard
from common.worker_metrics import run_with_metrics
from services.roles import RoleSwitching


def main(argv: list[str] | None = None) -> int:
    return guard("prefill_worker", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg = config.flags(argv, config.WorkerConfig, "kairos prefill-worker",
                       "Kairos prefill worker: prefills prompts and pushes their KV cache to decode workers. "
                       "Connects to the router; needs no other address.")

    async def serve_it() -> int:
        logging.configure("prefill_worker", level=cfg.log_level, fmt=cfg.log_format)
        return await run_with_metrics(cfg, RoleSwitching(cfg, "prefill"))  # it follows SetRole

    return run(serve_it)


if __name__ == "__main__":
    sys.exit(main())
