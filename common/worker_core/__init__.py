"""The workers' rules without sockets, clocks or engines: `DecodeCore` and `PrefillCore`, as
common/router_core/ is the router's.

A core holds everything a worker decides (its Hello, the composition of its heartbeats, the
admission of work and what it refuses, its ledgers of what it holds, cancellation, its drain)
and acts through the ports its shell implements (`WorkerPorts`: send a message to the router,
start and abort a request in the engine, heartbeat soon, release reserved KV). Time (`now`) and
the engine's load (`EngineLoad`) come in with the calls.

Two shells run the same cores: the live services (common/worker.py, services/decode_worker/,
services/prefill_worker/: ZeroMQ, NIXL, the asyncio loop, the clock) and the simulator's workers
(sim/state.py: the simulated `Batcher`, messages handed to the in-process router cores).
"""

from common.worker_core.base import EngineInfo, WorkerCore
from common.worker_core.decode import DecodeCore, Pending
from common.worker_core.ports import NULL_LOG, Log, WorkerPorts
from common.worker_core.prefill import PrefillCore

__all__ = ["NULL_LOG", "DecodeCore", "EngineInfo", "Log", "Pending", "PrefillCore", "WorkerCore", "WorkerPorts"]
