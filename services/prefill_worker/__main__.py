"""`python -m services.prefill_worker` / `kairos prefill-worker`."""

from __future__ import annotations

import sys

from common import config, logging
from common.engines import make_engine
from common.service import run
from common.startup import guard
from common.worker_metrics import run_with_metrics
from services.prefill_worker.service import PrefillWorker


def main(argv: list[str] | None = None) -> int:
    return guard("prefill_worker", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg = config.flags(argv, config.WorkerConfig, "kairos prefill-worker",
                       "Kairos prefill worker: prefills prompts and pushes their KV cache to decode workers. "
                       "Connects to the router; needs no other address.")

    async def serve_it() -> int:
        logging.configure("prefill_worker", level=cfg.log_level, fmt=cfg.log_format)
        return await run_with_metrics(cfg, PrefillWorker(cfg, make_engine(cfg, "prefill")))

    return run(serve_it)


if __name__ == "__main__":
    sys.exit(main())
