"""The `kairos` command: one entry point for every service and tool."""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kairos.up", "start a local cluster: router, monitor, prefill and decode workers"),
    "demo": ("kairos.demo", "the demo: a 2P2D cluster replaying a bursty trace slice, baseline vs kairos"),
    "router": ("services.router.__main__", "run the router (HTTP API + routing decisions)"),
    "prefill-worker": ("services.prefill_worker.__main__", "run a prefill worker"),
    "decode-worker": ("services.decode_worker.__main__", "run a decode worker"),
    "monitor": ("services.monitor.__main__", "run the monitor (metrics, dashboard)"),
    "sim": ("sim.cli", "discrete-event simulation of a trace under one or more policies"),
    "sessions": ("common.sessions", "write a multi-turn chat or agentic trace with prefix hash_ids"),
    "tune": ("sim.tune", "tune each policy's split and knobs on one trace slice, report them on another"),
    "plan": ("sim.plan", "the fewest GPUs, split and settings that meet an SLO on your trace (simulated)"),
    "bench": ("kairos.loadgen", "replay a trace against an OpenAI-compatible endpoint"),
    "bench-router": ("bench.router_throughput", "measure the router's throughput and added latency"),
    "bench-decision": ("bench.decision_cost", "measure the cost of one routing decision"),
    "kv-bench": ("common.kv.bench", "measure KV transfer throughput over NIXL (host memory, or GPU memory)"),
    "profile": ("common.engines.profile", "profile an engine and fit the performance model"),
    "make-tiny-model": ("common.engines.tiny_model", "write a tiny random Llama model + tokenizer locally"),
    "keys": ("kairos.keys", "create CURVE keys for an authenticated bus"),
    "health": ("kairos.health", "check a service's health (for container health checks)"),
    "top": ("services.monitor.top", "live cluster view in the terminal"),
}


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: kairos COMMAND [options]   (kairos COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {c:<{width}}  {h}" for c, (_, h) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = args[0], args[1:]
    if cmd not in COMMANDS:
        print(f"kairos: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    rc: int = module.main(rest)
    return rc


if __name__ == "__main__":
    sys.exit(main())
