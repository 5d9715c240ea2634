"""A worker process that follows the role planner: it runs the service of its current role
(services/prefill_worker/, services/decode_worker/) and, when that service returns after a
SetRole (common/worker.py: drained, engine switched in place), the service of the new role on
the same engine and router connections, without a restart. `kairos prefill-worker` and `kairos
decode-worker` both run this; their flag only says the role a worker starts in.
"""

from __future__ import annotations

from common import messages as m
from common.config import WorkerConfig
from common.engines import make_engine
from common.worker import WorkerService
from services.decode_worker.service import DecodeWorker
from services.prefill_worker.service import PrefillWorker

SERVICES: dict[str, type[PrefillWorker] | type[DecodeWorker]] = {"prefill": PrefillWorker, "decode": DecodeWorker}


class RoleSwitching:
    """The worker of this process, whatever its role now (run_with_metrics samples its heartbeat)."""

    def __init__(self, cfg: WorkerConfig, role: m.Role, worker: WorkerService | None = None) -> None:
        self.cfg = cfg
        self.worker: WorkerService = worker if worker is not None else SERVICES[role](cfg, make_engine(cfg, role))

    def heartbeat(self) -> m.Msg:
        return self.worker.heartbeat()

    async def run(self) -> int:
        while True:
            rc = await self.worker.run()
            role = self.worker.next_role
            if role is None:
                return rc
            self.worker = SERVICES[role](self.cfg, self.worker.engine, previous=self.worker)
