"""Configuration: one frozen Struct per service, loaded once and passed down.

Order (later wins): the Struct's defaults, a TOML or JSON file (`--config FILE` or
KAIROS_CONFIG), environment variables `KAIROS_<FIELD>` (upper case), then command-line flags
`--<field-with-dashes>`. The flags and their help come from the Struct's fields, so `--help`
always matches what the service reads. Nothing else in the code reads os.environ.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args, get_origin, get_type_hints

import msgspec

from common.errors import ConfigError

ENV_PREFIX = "KAIROS_"

# The one default performance profile of every command (kairos up, tune, sim, demo) and of compose and
# Kubernetes: Llama-2-70B on four H100s, fitted to measured step times (held-out MAPE 2-8 %) and the
# profile every simulated figure in docs/ is measured on. a100-dsv2-lite, up's and compose's earlier
# default, was chosen to match published figures, not measured; it is still there by name.
DEFAULT_PROFILE = "h100-llama2-70b-tp4"

T = TypeVar("T", bound=msgspec.Struct)


def doc(help_text: str) -> msgspec.Meta:
    """A config field's --help text: `name: Annotated[int, doc("...")] = default`."""
    return msgspec.Meta(description=help_text)


# -------------------------------------------------------------------- the service configs


class BusConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the router's bus sockets are; every service shares these fields."""

    router_host: Annotated[str, doc("host of the router's bus sockets (workers and monitor connect here)")] = "127.0.0.1"
    work_port: Annotated[int, doc("router ROUTER socket: work, results, tokens")] = 5555
    heartbeat_port: Annotated[int, doc("unused since bus protocol 2 (heartbeats travel on the work connection, "
                                       "bound to their sender); accepted so existing configurations still load")] = 5556
    telemetry_port: Annotated[int, doc("router PUB socket: decisions and outcomes for the monitor")] = 5557
    curve_keys_dir: Annotated[str, doc("directory made by `kairos keys`; set it to require CURVE on the bus")] = ""
    curve_key_name: Annotated[str, doc("this service's own CURVE key pair in curve_keys_dir (default: a router "
                                       "`router`; a worker the key named after its worker_id, else the shared "
                                       "`worker` key of older releases; the monitor `monitor`)")] = ""
    curve_server_key: Annotated[str, doc("the router's public key (in curve_keys_dir) a worker or monitor checks the "
                                         "router against (default `router`; replicated routers with keys of "
                                         "their own: name each in `routers` / `telemetry` instead)")] = ""
    max_message_bytes: Annotated[int, doc("largest bus message accepted, bytes")] = 64 << 20
    zmq_heartbeat_s: Annotated[float, doc("ZeroMQ connection heartbeat, seconds: a peer silent 3x this is "
                                          "disconnected and reconnected (0: off)")] = 1.0
    log_level: Annotated[str, doc("debug, info, warning or error")] = "info"
    log_format: Annotated[str, doc("json, console, or auto (json unless stdout is a terminal)")] = "auto"
    otlp_traces_endpoint: Annotated[str, doc("OpenTelemetry collector to export request traces to, over OTLP/HTTP "
                                             "(e.g. http://collector:4318/v1/traces; vLLM's flag of the same name); "
                                             "empty: no tracing, and it costs nothing")] = ""


class RouterConfig(BusConfig, frozen=True, kw_only=True):
    http_host: Annotated[str, doc("address the HTTP API listens on")] = "127.0.0.1"
    http_port: Annotated[int, doc("port of the OpenAI-compatible HTTP API")] = 8000
    http_reuse_port: Annotated[bool, doc("replicated routers on one host: bind the HTTP port with SO_REUSEPORT so "
                                         "several routers share it and the kernel spreads connections")] = False
    http_fd: Annotated[int, doc("serve HTTP on this already-listening TCP socket, a file descriptor inherited from "
                                "the process that started the router (kairos up keeps it open across router "
                                "restarts, so a connection made while no router runs waits instead of being "
                                "refused) instead of binding http_host:http_port; -1: bind")] = -1
    metrics_port: Annotated[int, doc("also serve /metrics on this port (0: only on the HTTP port); give each "
                                     "replica its own, as replicas share the HTTP port")] = 0
    bind_host: Annotated[str, doc("address the bus sockets bind to")] = "127.0.0.1"
    policy: Annotated[str, doc("routing policy, by its name in the policy registry "
                               "(common/policy/registry.py)")] = "kairos"
    profile: Annotated[str, doc("performance profile used when a worker reports no coefficients")] = DEFAULT_PROFILE
    tuned: Annotated[str, doc("set by `kairos up --tuned`: the tune file the policy's knobs and engine settings "
                              "came from, as JSON (file, profile, settings); named in the start line and "
                              "/v1/kairos/stats")] = ""
    served_model_name: Annotated[str, doc("model name the API reports and accepts")] = "kairos-sim"
    tokenizer: Annotated[str, doc("'simple' (the documented word tokenizer) or a Hugging Face tokenizer directory")] = "simple"
    tool_call_parser: Annotated[str, doc("vLLM's tool-call parser for the model (vLLM's --tool-call-parser, e.g. "
                                         "hermes; needs vLLM on the router host and --tokenizer)")] = ""
    enable_auto_tool_choice: Annotated[bool, doc("let the model call tools on its own (vLLM's "
                                                 "--enable-auto-tool-choice; with tool_call_parser)")] = False
    max_prompt_tokens: Annotated[int, doc("longest prompt accepted (HTTP 400 above)")] = 32768
    max_output_tokens: Annotated[int, doc("largest max_tokens accepted")] = 8192
    default_max_tokens: Annotated[int, doc("max_tokens when the client gives none")] = 256
    ttft_slo: Annotated[float, doc("default TTFT SLO, seconds")] = 2.0
    tbt_slo: Annotated[float, doc("default TBT SLO, seconds")] = 0.1
    tbt_delivery_allowance_ms: Annotated[float, doc(
        "milliseconds of every token's gap the decode guard leaves for delivery beyond what the router measures: "
        "the network and the client's read, which the router cannot see. Steps are planned to the TBT SLO less "
        "this and the measured part (the router's write gap less the worker's step, P99; see "
        "tbt_delivery_measured), at most half the SLO in all. Raise it when clients see TBT misses the router's "
        "request_done records (tbt_max_s) do not; the allowance in force is the router's "
        "kairos_tbt_delivery_allowance_seconds gauge and its delivery_allowance log lines")] = 0.0
    tbt_delivery_measured: Annotated[bool, doc(
        "add the measured delivery delay to tbt_delivery_allowance_ms: the P99.9 of the router's gap between two "
        "socket writes of a stream's tokens less the step time the worker reported (the worker's loop, the bus, "
        "the router's loop and write); off: the configured part alone")] = True
    heartbeat_interval: Annotated[float, doc("worker heartbeat interval the router asks for, seconds")] = 0.1
    liveness: Annotated[int, doc("a worker silent for liveness x heartbeat_interval is declared dead")] = 10
    max_in_flight: Annotated[int, doc("admission limit: requests in flight before HTTP 429")] = 4096
    queue_budget: Annotated[float, doc(
        "admission: a request that cannot be placed at once and whose predicted time to first token (the "
        "prefill workers' queues and the requests waiting before it, or when the requests holding decode room "
        "end) is over this many seconds is refused at once with HTTP 429 and a Retry-After from the predicted "
        "drain time, before any byte of a stream; one let wait that is not placed in time for it is refused "
        "then (429, still before any byte) (0: each request's own TTFT SLO, ttft_slo or its body's "
        "ttft_slo; -1: never refused on a prediction, it waits up to kv_wait_timeout)")] = 0.0
    client_share: Annotated[float, doc(
        "admission: the fraction of max_in_flight one client (its API key when it sends one other than the "
        "router's own api_key, else its address) may hold in flight; past it HTTP 429 client_share. Behind a "
        "gateway that funnels every client through one address, set 1 (no share)")] = 0.25
    max_batch: Annotated[int, doc(
        "most sub-requests one HTTP request may make (the prompts of a batched 'prompt' list times n): past "
        "it, or past the client's share, HTTP 400 before any work starts")] = 256
    log_requests: Annotated[bool, doc("write the request_done line (route, workers, TTFT, outcome of each "
                                      "request) at info level; off, only with --log-level debug (the line "
                                      "is a few percent of the router's CPU per request)")] = False
    kv_wait_timeout: Annotated[float, doc("seconds a request that finds no decode worker with KV room waits for "
                                          "some before HTTP 503 (0: 503 at once)")] = 30.0
    kv_wait_max: Annotated[int, doc("requests waiting for KV room before new ones get HTTP 503 at once")] = 1024
    replicas: Annotated[int, doc(
        "router replicas sharing the workers (kairos up --routers sets it; any number above 1 turns this "
        "on). Each tells the decode workers the request its wait queue would decide first, and their "
        "heartbeats echo every replica's; when a heartbeat may show room, every replica hears it at once "
        "and they take turns in one router's retry order (replica_stagger_ms apart), each deciding after "
        "the turns before it have dispatched and the workers' heartbeats show it, as one router decides "
        "one request after another")] = 1
    replica_stagger_ms: Annotated[float, doc(
        "milliseconds between the replicas' turns at a heartbeat's room, at least: each replica spaces them by "
        "the relay it measures (its dispatches to the heartbeats that acknowledge them, P90, at most 50 ms; "
        "the replica_relay log line) when that is longer, so that each turn sees the dispatches of the turns "
        "before it (0: every replica decides at once, each blind to the others' dispatches)")] = 3.0
    heartbeat_retry_ms: Annotated[float, doc(
        "a worker's heartbeat decides the waiting requests again at most once per this many "
        "milliseconds (the heartbeats between are folded into the next retry); a request's end or a "
        "deflection's first token still retries at once. Each retry decides up to 64 waiting requests, "
        "so under overload a fleet's heartbeats (2,560 a second from 256 workers) would otherwise cost "
        "the router more than a core (0: at every heartbeat)")] = 10.0
    request_timeout: Annotated[float, doc("deadline of a request from arrival, seconds")] = 300.0
    drain_grace_s: Annotated[float, doc(
        "on SIGTERM, keep serving this many seconds with /ready answering 503 and every response closing "
        "its connection, before it stops listening and drains: behind a load balancer, set it above the "
        "time its health check takes to take a router out (HAProxy: fall x inter); 0: stop listening at once "
        "(other routers on the port get the new connections; open ones are still served)")] = 0.0
    max_attempts: Annotated[int, doc("dispatch attempts per request when workers die before its first token")] = 3
    max_migrations: Annotated[int, doc("times a request whose tokens are streaming is resumed on another decode worker when its own dies or freezes (0: fail it with worker_lost_midstream)")] = 2
    park_timeout: Annotated[float, doc("seconds a request whose worker died waits for a worker to (re)register when no other can take it, before it fails")] = 10.0
    worker_wait: Annotated[float, doc("when no worker can take a request (router just restarted, workers "
                                      "restarting), hold it this long for one to register before HTTP 503, "
                                      "seconds")] = 5.0
    api_key: Annotated[str, doc("if set, clients must send 'Authorization: Bearer <key>'")] = ""
    max_body_bytes: Annotated[int, doc("largest HTTP request body accepted")] = 4 << 20
    http_header_timeout_s: Annotated[float, doc(
        "a connection must send a request's headers within this many seconds of opening (or of its last "
        "response), however slowly it trickles them, or it is closed")] = 10.0
    http_body_timeout_s: Annotated[float, doc(
        "a request's body must arrive within this many seconds of its headers, or the client gets a 408")] = 30.0
    http_max_connections: Annotated[int, doc(
        "open HTTP connections; past it a new one closes the longest-idle one (never one being served), and "
        "is refused with a 503 only when every connection is busy")] = 8192
    http_max_connections_per_client: Annotated[int, doc(
        "open HTTP connections from one address; past it that address's longest-idle one is closed, or the new "
        "one refused (429) when all are busy. Behind a gateway or balancer that funnels every client through "
        "one address, raise it to http_max_connections")] = 4096
    forwarded_allow_ips: Annotated[str, doc(
        "proxies whose X-Forwarded-For / X-Forwarded-Proto the router believes, comma separated addresses or "
        "networks, * for any: a request through one of them counts against its forwarded client's "
        "admission share (client_share; connection limits always count the proxy's own address); from any "
        "other peer the headers are ignored, so a client cannot pose as many. Empty: believe none (and skip "
        "the header parsing). Default: a proxy on the same host")] = "127.0.0.1,::1"
    enable_prompt_tokens_details: Annotated[bool, doc(
        "report usage.prompt_tokens_details (cached_tokens: prompt tokens the engine found in its prefix "
        "cache), as vLLM's server flag of the same name; off by default there too")] = False
    ledger: Annotated[bool, doc("fold work dispatched since a worker's last heartbeat into its load view")] = True
    prepare_interval_ms: Annotated[float, doc(
        "the policy prepares the workers' changed views (between requests) at most this often, milliseconds: "
        "heartbeats from a large fleet then cost one preparation per interval, not one each; a request "
        "that comes first prepares what changed itself (0: after every change)")] = 5.0
    prepare_when_idle: Annotated[bool, doc(
        "prepare changed views while no request is in flight too; off (the default), a heartbeat at an idle "
        "router prepares nothing and the next request's decision prepares what changed since (at most the "
        "whole fleet's views once: about 10 us a worker)")] = False
    idle_read_ms: Annotated[float, doc(
        "while no request is in flight, the work socket is read at most this often, milliseconds, with 256 "
        "workers or more (proportionally less often with fewer: 6 workers, every 1.2 ms): a large fleet's "
        "heartbeats are then read in batches, not one per event-loop wakeup (256 workers send 2,560 a second); "
        "a request arriving in a pause has what waits read first, so its decision sees every heartbeat; a "
        "request's own messages are read as they come (0: read every message as it comes)")] = 50.0
    alpha: Annotated[float, doc("kairos: deflect iff TTFT_D <= alpha x TTFT_P")] = 1.6
    beta: Annotated[float, doc("kairos: TBT budget = beta x strictest resident TBT SLO")] = 0.9
    candidates: Annotated[str, doc("kairos: chunk candidates, comma separated")] = "2048,1024,512,256,128"
    transfer_term: Annotated[bool, doc("kairos: add the KV transfer time to the prefill path's TTFT")] = True
    max_deflections: Annotated[int, doc("kairos: concurrent in-place prefills per decode worker")] = 4
    predictor: Annotated[str, doc("kairos: TTFT prediction, replay (the workers' known queues) or paper (Equation 1)")] \
        = "replay"
    budget_fit: Annotated[bool, doc("kairos: chunk schedules leave token budget to the deflections in flight")] = True
    share_expect: Annotated[bool, doc("kairos replay predictor: count the tokens later requests add to a prompt's "
                                      "last prefill step")] = False
    late_binding: Annotated[bool, doc("kairos: hold a request at the router while the prefill queues are deep and no "
                                      "decode worker can take it; dispatch it when one frees room")] = True
    late_depth: Annotated[float, doc("kairos late binding: hold while the prefill worker has this many token "
                                     "budgets queued")] = 1.0
    late_order: Annotated[str, doc("kairos late binding: decide waiting requests again short (those that can still "
                                   "meet the TTFT SLO first, the shortest prefill first among them: the prompt less "
                                   "the prefix a prefill worker holds), slack (those first, by arrival) or fifo")] = "short"
    decode_room: Annotated[bool, doc("kairos: keep a request at the router while every decode worker's decode step, "
                                     "with it added, would pass the less of decode_beta x the TBT SLO of the "
                                     "requests running there and that SLO / the worker's measured margin (less a retain_chunk chunk "
                                     "step's cost where a deflected prompt is still prefilling there), on both paths (protects TBT when "
                                     "the decode pool is the bottleneck, costs TTFT; docs/cost-model.md)")] = True
    decode_beta: Annotated[float, doc("kairos decode room: plan decode-only steps to this fraction of the strictest "
                                      "resident TBT SLO, or less where the worker's measured margin asks for less: "
                                      "the decodes' contexts grow after the check")] = 0.95
    retain: Annotated[bool, doc("kairos: the third path (route retain): a request no decode worker has room for "
                                "is decoded by a prefill worker itself (no KV transfer) when its decodes, this one "
                                "added, leave a retain_chunk prefill chunk within decode_beta x the TBT SLO and "
                                "its first token is predicted within the TTFT SLO (engines that cannot decode on "
                                "a prefill worker, vLLM's, are never sent one)")] = True
    retain_chunk: Annotated[int, doc("kairos retain: the prefill chunk (tokens) a prefill worker must keep room for "
                                     "beside the requests it decodes (64: on an A100 a chunk of 512 beside even one "
                                     "decode takes longer than a 100 ms TBT SLO, so the path never opened there); the decode "
                                     "room also keeps a chunk step of this size beside a deflected prompt still "
                                     "prefilling on a decode worker")] = 64
    retain_max: Annotated[int, doc("kairos retain: requests a prefill worker decodes at most")] = 64
    per_worker_models: Annotated[bool, doc("kairos: use each worker's own model coefficients from its heartbeats")] = True
    bias_correction: Annotated[bool, doc("scale each worker's model by the step bias its heartbeats report (median "
                                         "measured / predicted step time; 2 % deadband)")] = True
    prefix_aware: Annotated[bool, doc("kairos: count only uncached prompt tokens when an engine reports hits")] = True
    overlap_weight: Annotated[float, doc("kv-aware: weight of a worker's uncached prompt tokens against its load")] \
        = 1.0
    prefix_cache: Annotated[bool, doc("keep a prefix index from the workers' cache reports and pass each worker's "
                                      "cached prompt tokens to the policy (off: every prompt counts whole)")] = True
    prefix_index_blocks: Annotated[int, doc("prefix index: most block hashes remembered (least recently seen "
                                            "dropped first)")] = 1 << 20
    planner: Annotated[bool | None, doc("the role planner (common/router_core/planner.py): move workers between the prefill "
                                 "and decode roles when the measured load says the other role is the bottleneck; "
                                 "with several routers only the one whose incarnation sorts first among those the "
                                 "workers report decides (`kairos sim` runs the same). Unset: on when the policy is "
                                 "kairos, off for a baseline policy (compared at its fixed split); "
                                 "KAIROS_PLANNER=false or `kairos up --planner off` turns it off")] = None
    planner_interval_s: Annotated[float, doc("role planner: seconds between its load samples")] = 5.0
    planner_window_s: Annotated[float, doc("role planner: seconds of samples a decision is judged on")] = 30.0
    planner_min_dwell_s: Annotated[float, doc("role planner: seconds a worker keeps a role before it may move")] = 60.0
    planner_min_gap_s: Annotated[float, doc("role planner: seconds between two flips at least (the flip rate bound; "
                                            "one flip at a time in any case)")] = 30.0
    planner_min_prefill: Annotated[int, doc("role planner: prefill workers it always leaves")] = 1
    planner_max_prefill: Annotated[int, doc("role planner: prefill workers it never goes above")] = 1 << 20
    planner_min_decode: Annotated[int, doc("role planner: decode workers it always leaves (at least 1)")] = 1
    planner_max_decode: Annotated[int, doc("role planner: decode workers it never goes above")] = 1 << 20
    planner_pin: Annotated[str, doc("role planner: workers it never moves, comma separated ids (e.g. prefill-0)")] = ""
    planner_step_hi: Annotated[float, doc(
        "role planner: a decode step (planned with its error margin) using this share of the TBT SLO's room above "
        "a lone sequence's step makes the decode pool short (it takes a prefill worker)")] = 0.9
    planner_step_lo: Annotated[float, doc(
        "role planner: ... at or above this share a decode worker is not given up, and a busy decode pool may "
        "take a prefill worker the prefill pool can spare (below planner_step_hi: the gap is the hysteresis)")] = 0.6
    planner_flip_timeout_s: Annotated[float, doc("role planner: a flipped worker not back under its new role after "
                                                 "this many seconds (it died, or its engine cannot change role) ends "
                                                 "the flip as abandoned, logged, and the planner goes on")] = 180.0
    eff_isl_threshold: Annotated[int, doc("conditional-disagg: prefill locally a prompt of fewer uncached tokens (0: off)")] \
        = 2048
    eff_isl_ratio_threshold: Annotated[float, doc("conditional-disagg: ... only if uncached/prompt is below this "
                                                  "(Dynamo 0.7; 1: no ratio condition)")] = 1.0
    prefill_busy_threshold: Annotated[float, doc("conditional-disagg: prefill locally when the prefill worker has more "
                                                 "than this x its token budget queued")] = 2.0
    decode_busy_threshold: Annotated[float, doc("conditional-disagg: never on a decode worker with more than this "
                                                "fraction of its KV in use")] = 0.9


class WorkerConfig(BusConfig, frozen=True, kw_only=True):
    worker_id: Annotated[str, doc("unique worker name (default: role-host-pid)")] = ""
    routers: Annotated[str, doc("replicated routers: every router's bus as host:work_port:heartbeat_port, "
                                "comma-separated (the worker registers with and heartbeats to each); empty: "
                                "the one router at router_host, work_port, heartbeat_port")] = ""
    engine: Annotated[str, doc("sim (simulated, timed by the profile) or vllm")] = "sim"
    profile: Annotated[str, doc("performance profile of the simulated engine (name or .json path)")] = DEFAULT_PROFILE
    time_scale: Annotated[float, doc("sim: multiply every modeled step time and KV transfer time by this (0.001: near-zero steps)")] = 1.0
    step_noise: Annotated[float, doc("sim: sigma of a mean-1 lognormal error on every step (model error; 0: none)")] = 0.0
    step_scale: Annotated[float, doc("sim: every step takes this times the profile's time (1.15: 15 % slower)")] = 1.0
    step_speed: Annotated[float, doc("sim: this worker's own step time factor (a mixed fleet)")] = 1.0
    slow_every: Annotated[float, doc("sim: mean seconds between slow periods (0: none)")] = 0.0
    slow_for: Annotated[float, doc("sim: mean length of a slow period, seconds")] = 1.0
    slow_factor: Annotated[float, doc("sim: step time factor in a slow period")] = 1.5
    straggler_p: Annotated[float, doc("sim: fraction of steps that straggle")] = 0.0
    straggler_factor: Annotated[float, doc("sim: step time factor of a straggling step")] = 3.0
    closed_loop: Annotated[bool, doc("decode workers: measure each step against the model and cut in-place "
                                     "prefill chunks so gaps stay within the TBT SLO at the measured error")] = True
    overrun_target: Annotated[float, doc("decode workers: the chance of a step over the TBT SLO the measured step "
                                         "error margin is read at (heartbeats report it; default 0.00033, "
                                         "common/engines/step_error.py TARGET); a step beside an in-place prefill "
                                         "chunk is planned for the smaller of this and 2e-5 (DECODE_TARGET, as a "
                                         "decode-only step): it holds every running decode, and one overrun breaks "
                                         "all of them")] = 0.00033
    model: Annotated[str, doc("vllm: model directory")] = ""
    served_model_name: Annotated[str, doc("model name reported to the router")] = "kairos-sim"
    metrics_host: Annotated[str, doc("address the worker's /metrics (its engine's metrics) listens on")] = "127.0.0.1"
    metrics_port: Annotated[int, doc("port of the worker's /metrics (0: none)")] = 0
    heartbeat_interval: Annotated[float, doc("heartbeat period, seconds (the router's Welcome overrides it)")] = 0.1
    kv_transport: Annotated[str, doc("nixl (real KV bytes over NIXL, timed by the profile) or modeled (time only, no bytes)")] \
        = "nixl"
    kv_timeout: Annotated[float, doc("deadline for one KV transfer, seconds")] = 10.0
    kv_handoff_timeout: Annotated[float, doc("decode workers: longest wait for a handed-off request's KV (prefill "
                                             "queue + transfer) before prefilling it in place; prefill workers: "
                                             "longest wait at drain for decode workers to pull KV, seconds")] = 15.0
    kv_pool_mib: Annotated[int, doc("nixl: host memory registered for KV blocks, MiB")] = 64
    kv_block_tokens: Annotated[int, doc("nixl: tokens per KV block")] = 16
    kv_bytes_per_token: Annotated[int, doc("nixl sim: KV bytes moved per token (0: the profile's, capped to fit the pool)")] = 0
    kv_fault_rate: Annotated[float, doc("fault injection for chaos tests: corrupt this fraction of pushed KV (keep 0)")] = 0.0
    max_queue_requests: Annotated[int, doc("requests queued on this worker before it answers busy")] = 1024
    prefill_token_budget: Annotated[int, doc("prefill role: tokens per engine step (vLLM max_num_batched_tokens); "
                                             "0: the profile's (vllm: vllm_token_budget)")] = 0
    decode_token_budget: Annotated[int, doc("decode role: tokens per engine step, decodes plus in-place prefill "
                                            "chunks; 0: the profile's (vllm: vllm_token_budget)")] = 0
    decode_chunk: Annotated[int, doc("decode role: largest in-place prefill chunk per request and step when the "
                                     "router sends no schedule (vLLM long_prefill_token_threshold); 0: the profile's")] = 0
    prefix_cache: Annotated[bool, doc("keep a prefix cache (finished requests' KV blocks stay until room is "
                                      "needed; vllm: its automatic prefix caching) and report it to the router")] = True
    prefix_block_tokens: Annotated[int, doc("sim engine: tokens per prefix-cache block")] = 16
    sim_max_model_len: Annotated[int, doc("sim engine: its context window, prompt plus output tokens, as a "
                                          "model's max_model_len (0: none)")] = 0
    deflect_admission: Annotated[bool, doc("decode workers: check every deflection's chunk schedule against the "
                                           "running decodes and the deflections already accepted (from any "
                                           "router) and reject what would break the TBT budget")] = True
    refit_interval: Annotated[float, doc("seconds between online refits of the step-time model from measured steps (engines that measure them; 0: off)")] = 30.0
    refit_max_mape: Annotated[float, doc("a refit is used only if its error on the recent steps is at most this")] = 0.25
    drain_timeout: Annotated[float, doc("on SIGTERM, seconds to finish held requests before handing them back")] = 30.0
    vllm_max_model_len: Annotated[int, doc("vllm: max model length")] = 2048
    vllm_kv_cache_mib: Annotated[int, doc("vllm: KV cache size, MiB")] = 256
    vllm_token_budget: Annotated[int, doc("vllm: max_num_batched_tokens")] = 512
    vllm_max_batch: Annotated[int, doc("vllm: max_num_seqs, the most requests in one batch")] = 64
    vllm_side_channel_host: Annotated[str, doc("vllm prefill workers (and decode workers the role planner may move, vllm_kv_both): the address decode workers reach this host's NIXL side channel on")] = "127.0.0.1"
    vllm_side_channel_port: Annotated[int, doc("vllm prefill workers: NIXL side-channel port (0: any free port; set one to open it in a firewall)")] = 0
    vllm_side_channel_bind: Annotated[str, doc("vllm prefill workers: address the NIXL side channel listens on (empty: the side-channel host; 0.0.0.0 when that host is a DNS name)")] = ""
    vllm_kv_buffer_device: Annotated[str, doc("vllm: NIXL KV buffer device (empty: the platform's, cuda on GPUs; cpu stages KV through host memory)")] = ""
    vllm_kv_both: Annotated[bool, doc(
        "vllm: start the engine in vLLM's kv_both KV role (it both produces and consumes KV over NIXL), so a SetRole "
        "from the router's role planner switches the worker between prefill and decode in place, engine kept; "
        "false: kv_producer (prefill) or kv_consumer (decode), and the worker refuses role changes")] = True
    vllm_profile: Annotated[str, doc(
        "vllm: the step-time model the worker reports to the routers: 'measured' (this engine's own: the profile "
        "stored in profile_store for its model, device, parallelism, dtype and quantization, measured by a short "
        "sweep of step times at the first start when none is stored), or a profile name / .json path "
        "(cpu-tiny-llama: the tier's tiny model on a CPU)")] = "measured"
    profile_store: Annotated[str, doc("vllm: directory of the profiles measured on engines, one file per set of "
                                      "keys (empty: $XDG_CACHE_HOME/kairos/profiles, else "
                                      "~/.cache/kairos/profiles)")] = ""
    vllm_engine_args: Annotated[str, doc(
        "vllm: any other vLLM engine argument, as `vllm serve` takes it, shell-quoted, e.g. '--tensor-parallel-size 4 "
        "--max-num-seqs 128 --gpu-memory-utilization 0.9' (vLLM's own parser reads it; on the command line such "
        "options may also be given directly). Those Kairos sets itself (scheduler, KV connector and role, token "
        "budget and chunk, prefix-cache events, async scheduling) are refused before the engine starts")] = ""


class MonitorConfig(BusConfig, frozen=True, kw_only=True):
    telemetry: Annotated[str, doc("replicated routers: every router's telemetry endpoint as host:port, comma "
                                  "separated (the monitor sums their counts and shows each replica); empty: "
                                  "the one router at router_host, telemetry_port")] = ""
    http_host: Annotated[str, doc("address the metrics and dashboard server listens on")] = "127.0.0.1"
    http_port: Annotated[int, doc("port of /metrics and the dashboard")] = 9100
    api_key: Annotated[str, doc("if set, every route but /health needs 'Authorization: Bearer <key>' (the "
                                "router's key)")] = ""
    services_status: Annotated[str, doc("the services file `kairos up` keeps (services.json in its log "
                                        "directory): the dashboard and `kairos top` then name the services held "
                                        "down for crash-looping; empty: none")] = ""


# -------------------------------------------------------------------- loading


def _field_help(cls: type[msgspec.Struct]) -> dict[str, tuple[Any, str]]:
    hints = get_type_hints(cls, include_extras=True)
    out: dict[str, tuple[Any, str]] = {}
    for name in cls.__struct_fields__:
        hint = hints[name]
        help_text = ""
        base = hint
        if get_origin(hint) is Annotated:
            base, *extra = get_args(hint)
            for e in extra:
                if isinstance(e, msgspec.Meta) and e.description:
                    help_text = e.description
        out[name] = (base, help_text)
    return out


def _is_flag(base: Any) -> bool:
    """A field set on or off (`--x` / `--no-x`, env true/false): bool, or bool | None (unset: a default decided elsewhere)."""
    return base is bool or base == bool | None


def add_arguments(parser: argparse.ArgumentParser, cls: type[msgspec.Struct],
                  choices: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """One flag per field of `cls`. `choices`: field -> {value: what it is}, the only values the
    flag takes (a registry's names, e.g. the routing policies), listed in its help."""
    parser.add_argument("--config", metavar="FILE", help="TOML or JSON file with any of the options below")
    defaults = cls()
    for name, (base, help_text) in _field_help(cls).items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        env = ENV_PREFIX + name.upper()
        values = (choices or {}).get(name)
        if values:
            help_text += ": " + "; ".join(f"{v} ({what})" if what else v for v, what in values.items())
        text = f"{help_text} (default: {default!r}; env {env})".replace("%", "%%")  # argparse formats help with %
        if _is_flag(base):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(flag, dest=name, type=base, default=None, metavar=name.upper(), help=text,
                                choices=list(values) if values else None)


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from e
    try:
        data = json.loads(raw) if p.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table of options")
    return data


def load(cls: type[T], *, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> T:
    """Build a config: defaults, then file, then environment, then flags, then `overrides`."""
    env = os.environ if env is None else env
    fields = _field_help(cls)
    data: dict[str, Any] = {}
    source: dict[str, str] = {}  # where each value came from, for the error that names it
    file = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    if file:
        for k, v in _read_file(file).items():
            if k not in fields:
                raise ConfigError(f"config file {file}: unknown option {k!r}", key=k, config_file=file,
                                  fix=f"remove {k!r} from {file} or correct its spelling (--help lists the options)")
            data[k] = v
            source[k] = f"{k} in {file}"
    for name, (base, _) in fields.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if _is_flag(base):
            data[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            data[name] = raw
        source[name] = ENV_PREFIX + name.upper()
    if args is not None:
        for name in fields:
            v = getattr(args, name, None)
            if v is not None:
                data[name] = v
                source[name] = "--" + name.replace("_", "-")
    if overrides:
        data.update(overrides)
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as e:
        raise invalid(cls, e, data, source) from e


def invalid(cls: type[msgspec.Struct], e: msgspec.ValidationError, data: Mapping[str, Any],
            source: Mapping[str, str]) -> ConfigError:
    """The error for a value of the wrong type: which key, where it was set, what it must be."""
    import re

    found = re.match(r"Expected `(?P<expected>[^`]+)`, got `(?P<got>[^`]+)` - at `\$\.(?P<key>\w+)", str(e))
    if found is None:
        return ConfigError(f"invalid configuration: {e}")
    key, expected = found["key"], found["expected"]
    where = source.get(key, key)
    default = getattr(cls(), key, None)
    named = where if where == key else f"{key} ({where})"
    return ConfigError(f"invalid configuration: {named} = {data.get(key)!r} is not a valid {expected}",
                       key=key, expected=expected, value=data.get(key), source=where,
                       fix=f"set {where} to a value of type {expected} (the default is {default!r}) or remove it")


def env_text(v: Any) -> str:
    """A setting's value as a KAIROS_* variable holds it: booleans true/false, lists comma-joined."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def to_env(cfg: msgspec.Struct, *, skip_defaults: bool = True) -> dict[str, str]:
    """The environment that reproduces `cfg` (what `kairos up` and compose pass to services)."""
    defaults = type(cfg)()
    out = {}
    for name in cfg.__struct_fields__:
        v = getattr(cfg, name)
        if skip_defaults and v == getattr(defaults, name):
            continue
        out[ENV_PREFIX + name.upper()] = str(v).lower() if isinstance(v, bool) else str(v)
    return out


def parse_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from e


class _Parser(argparse.ArgumentParser):
    """A service's flags: a mistake is a ConfigError (one log line with the fix, common/startup.py),
    not argparse's usage text on stderr."""

    def error(self, message: str) -> Any:
        raise ConfigError(f"{self.prog}: {message}", event="config_invalid",
                          fix=f"correct the command line (`{self.prog} --help` lists the options)")


def flags(argv: Sequence[str] | None, cls: type[T], prog: str, description: str,
          choices: Mapping[str, Mapping[str, str]] | None = None) -> T:
    """`cls` from the command line (over the environment and --config); `choices`: see add_arguments.
    A worker with `--engine vllm` also takes options it does not define: they are vLLM engine
    arguments, appended to vllm_engine_args."""
    # each option's help says its default itself (add_arguments): no formatter that adds another
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    add_arguments(parser, cls, choices)
    extra_field = "vllm_engine_args"
    if extra_field not in cls.__struct_fields__:
        return load(cls, args=parser.parse_args(argv))
    ns, extra = parser.parse_known_args(argv)
    cfg = load(cls, args=ns)
    if not extra:
        return cfg
    if getattr(cfg, "engine", "") != "vllm":
        parser.error(f"unrecognized arguments: {' '.join(extra)} (vLLM engine arguments need --engine vllm)")
    from common.engines.vllm_args import join

    given = getattr(cfg, extra_field)
    return load(cls, args=ns, overrides={extra_field: f"{given} {join(extra)}".strip()})
