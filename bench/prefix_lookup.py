"""The router's per-request prefix-index cost: hashing a prompt's token ids into blocks and
finding, per worker, the longest cached prefix (`common/router_core/prefix.py`, `RouterPrefix.lookup`).

    python -m bench.prefix_lookup [--blocks 16] [--workers 4] [--prompts 50]

Four workers (16-token blocks, as vLLM's) each report the blocks of a quarter of `--prompts`
random 8k-token prompts; each prompt's first 512, 2048 and 8192 tokens are then looked up once
(one hit per lookup, at its owner) after a warm-up. Reports the p50 and the largest, in
microseconds, per prompt length; the router pays this once per request, before the policy.
"""

from __future__ import annotations

import argparse
import random
import time

from common import messages as m
from common.prefix_hash import block_hashes
from common.router_core.prefix import RouterPrefix


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_lookup", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=16, help="tokens per cache block (default 16)")
    p.add_argument("--workers", type=int, default=4, help="workers reporting caches (default 4)")
    p.add_argument("--prompts", type=int, default=50, help="distinct 8k-token prompts (default 50)")
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(8192)] for _ in range(a.prompts)]
    rp = RouterPrefix()
    for i in range(a.workers):
        stored = [h for q in prompts[i::a.workers] for h in block_hashes(q, a.blocks)]
        rp.on_heartbeat(m.DecodeHeartbeat(
            worker_id=f"w{i}", incarnation="x", seq=1, batch=0, kv_tokens=0, kv_free_tokens=0, kv_capacity_tokens=0,
            resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None, token_budget=1,
            prefix=m.PrefixSummary(block_tokens=a.blocks, stored=stored)))
    for q in prompts[:5]:
        rp.lookup(q)
    for n in (512, 2048, 8192):
        ts = []
        for q in prompts:
            t0 = time.perf_counter_ns()
            rp.lookup(q[:n])
            ts.append(time.perf_counter_ns() - t0)
        ts.sort()
        print(f"prompt {n:5d} tokens, {a.blocks}-token blocks, {a.workers} workers, index {len(rp.index)} blocks: "
              f"p50 {ts[len(ts) // 2] / 1e3:.0f} us, max {ts[-1] / 1e3:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
