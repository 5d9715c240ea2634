"""Where a live router's CPU per request goes, from outside the process: `kairos bench-router --account RATE`.

py-spy --gil sees only the Python the main thread runs while it holds the GIL. This accounts for the
rest, during a request step at RATE (four windows, one after the other, so no tool counts another's
cost):

1. `/proc/PID/task/*/stat` and `status` over `window` seconds: user and system CPU and context switches
   per thread (the main thread, running the event loop, against libzmq's I/O thread(s) and any other),
   nothing else attached;
2. `perf record -g` for `window` seconds: the samples by thread and shared object (kernel, libpython,
   libzmq, uvloop, httptools, msgspec...) and the top symbols, kernel ones included;
3. `perf stat` counting the syscalls per thread for `window` seconds (in the kernel, no ptrace; all of
   them through raw_syscalls, and the usual ones one by one);
4. `strace` of the bus syscalls for `strace_s` seconds (ptrace slows the router, so nothing is timed
   here, only counted): the bus messages in each direction by type, found by their msgspec tag in the
   bytes each read and write carries (a message's type name is spelled out in its msgpack map), per
   request taken as a DecodeWork or PrefillWork sent.

Per-request figures divide by the requests the step completed per second times the window.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")

# the message types a router's bus carries (common/messages.py), as their msgspec tags
BUS_TYPES = ("DecodeWork", "PrefillWork", "PrefillDone", "TokenBatch", "Cancel", "RequestFailed",
             "DecodeHeartbeat", "PrefillHeartbeat", "KvWant", "KvTarget", "KvReady", "QueueHead",
             "DecisionRecord", "RequestRecord", "RouterStats", "WorkerSeen", "RoleFlip", "WorkerLost",
             "Hello", "Welcome", "SetRole", "Drain", "Reregister", "Goodbye")
# msgpack: the key "type", then the name as a fixstr, whose length byte strace prints escaped (octal or hex)
# the syscalls a router makes under load (every one is also in raw_syscalls' total, "all"); a short
# list because perf takes seconds to arm each of the 360 tracepoints
SYSCALLS = ("read", "readv", "recvfrom", "recvmsg", "write", "writev", "sendto", "sendmsg", "epoll_wait",
            "epoll_pwait", "epoll_ctl", "poll", "ppoll", "getpid", "futex", "getrandom", "io_uring_enter", "ioctl",
            "mmap", "munmap", "madvise", "brk", "mprotect", "close", "accept4", "getsockname", "getsockopt",
            "setsockopt", "timerfd_settime", "clock_nanosleep", "sched_yield", "shutdown")
_TAG = re.compile(rb"type(?:\\[0-7]{1,3}|\\x[0-9a-f]{2}|.)(" + b"|".join(t.encode() for t in BUS_TYPES) + rb")\b")


def threads(pid: int) -> dict[int, dict[str, Any]]:
    """Per thread: its name, user and system CPU seconds, voluntary and involuntary context switches."""
    out: dict[int, dict[str, Any]] = {}
    for d in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (d / "stat").read_text()
            status = (d / "status").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        sw = {k: int(v) for k, v in (ln.split(":\t") for ln in status.splitlines()
                                     if ln.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))}
        out[int(d.name)] = {"name": name, "utime": int(f[11]) / TICK, "stime": int(f[12]) / TICK,
                            "vcs": sw.get("voluntary_ctxt_switches", 0),
                            "nvcs": sw.get("nonvoluntary_ctxt_switches", 0)}
    return out


def thread_delta(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    rows = []
    for tid, t in b.items():
        s = a.get(tid, {"utime": 0.0, "stime": 0.0, "vcs": 0, "nvcs": 0})
        rows.append({"tid": tid, "name": "main" if tid == pid else t["name"],
                     **{k: t[k] - s[k] for k in ("utime", "stime", "vcs", "nvcs")}})
    return sorted(rows, key=lambda r: -(r["utime"] + r["stime"]))


def parse_perf_per_thread(text: str) -> dict[str, dict[str, int]]:
    """`perf stat --per-thread -x,` over syscall tracepoints: {thread: {syscall: calls}}."""
    by: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        f = line.split(",")
        if len(f) < 4 or not f[1].strip().isdigit():
            continue
        ev = f[3]
        if int(f[1]) == 0 or not ev.startswith(("syscalls:sys_enter_", "raw_syscalls:sys_enter")):
            continue
        name = "all" if ev.startswith("raw_") else ev.removeprefix("syscalls:sys_enter_")
        by.setdefault(f[0].strip(), {})[name] = int(f[1])
    return by


def bus_messages(strace_out: str) -> dict[str, Counter[str]]:
    """Message types found in the bus reads and writes of an `strace -s` log, by direction."""
    got: dict[str, Counter[str]] = {"in": Counter(), "out": Counter()}
    for line in strace_out.splitlines():
        m = re.match(r"(?:\d+\s+)?(\w+)\(\d+, \"(.*)\"", line)
        if not m:
            continue
        call, data = m.group(1), m.group(2)
        way = "in" if call in ("read", "recvfrom", "recvmsg", "readv") else "out"
        # strace escapes non-printable bytes as \xNN; the tag names are plain ASCII either way
        for t in _TAG.findall(data.encode("latin-1", "replace")):
            got[way][t.decode()] += 1
    return got


def perf_profile(pid: int, seconds: float, out_dir: Path) -> dict[str, Any]:
    exe = shutil.which("perf")
    if exe is None:
        return {"error": "perf not installed (linux-tools)"}
    data = out_dir / "router-perf.data"
    rec = subprocess.run([exe, "record", "-F", "1999", "-g", "-p", str(pid), "-o", str(data), "--", "sleep",
                          f"{seconds:g}"], capture_output=True, text=True, timeout=seconds + 60)
    if rec.returncode != 0 or not data.exists():
        return {"error": f"perf record failed ({rec.returncode}): {rec.stderr.strip()[-400:]}"}

    def report(*sort: str) -> list[tuple[float, str]]:
        r = subprocess.run([exe, "report", "-i", str(data), "--no-children", "--stdio", "--percent-limit", "0.3",
                            "-g", "none", "--sort", ",".join(sort)], capture_output=True, text=True, timeout=120)
        rows = []
        for ln in r.stdout.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+(.*)$", ln)
            if m:
                rows.append((float(m.group(1)), " ".join(m.group(2).split())))
        (out_dir / f"router-perf-{'-'.join(sort)}.txt").write_text(r.stdout)
        return rows

    return {"by_thread_dso": report("comm", "dso"), "by_symbol": report("comm", "dso", "sym")[:60], "data": str(data)}


def account(pid: int, rate: float, window: float, strace_s: float, out_dir: Path,
            workers: dict[str, int] | None = None) -> dict[str, Any]:
    """The four windows above, one after the other; `rate` the requests per second the step sends.
    `workers` (name: pid): their threads are read in the first window too (the other side of the
    router's bus messages, and of a request's first token)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"rate": rate, "window_s": window}
    workers = workers or {}
    wa = {n: threads(p) for n, p in workers.items()}
    a, t0 = threads(pid), time.perf_counter()
    time.sleep(window)
    b, t1 = threads(pid), time.perf_counter()
    res["threads"] = thread_delta(a, b, pid)
    res["threads_s"] = t1 - t0
    res["worker_threads"] = {n: thread_delta(wa[n], threads(p), p) for n, p in workers.items()}
    res["perf"] = perf_profile(pid, window, out_dir)
    perf = shutil.which("perf")
    pstat = out_dir / "router-syscalls-per-thread.txt"
    if perf is not None:
        t2 = time.perf_counter()
        events = ",".join(["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{n}" for n in SYSCALLS)])
        subprocess.run([perf, "stat", "--per-thread", "-x", ",", "-e", events, "-p", str(pid),
                        "-o", str(pstat), "--", "sleep", f"{window:g}"], capture_output=True, timeout=window + 60)
        res["syscalls"] = parse_perf_per_thread(pstat.read_text()) if pstat.exists() else {}
        res["syscalls_s"] = time.perf_counter() - t2
    strace = shutil.which("strace")
    if strace is not None and strace_s > 0:
        slog = out_dir / "router-strace.txt"
        sp = subprocess.Popen([strace, "-f", "-qq", "-p", str(pid), "-s", "65536", "-o", str(slog),
                               "-e", "trace=read,write,recvfrom,sendto,recvmsg,sendmsg,readv,writev"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(strace_s)
        sp.terminate()
        sp.wait(timeout=30)
        res["bus_messages"] = {k: dict(v) for k, v in bus_messages(slog.read_text(errors="replace")).items()}
        slog.unlink(missing_ok=True)  # large; the counts are kept
    return res


def summary(res: dict[str, Any], completed_rate: float) -> list[str]:
    """Per-request lines for the console (and the docs' table)."""
    n = completed_rate * res["threads_s"]
    lines = [f"accounting at {completed_rate:.0f} req/s completed over {res['threads_s']:.1f} s ({n:.0f} requests)"]
    if n <= 0:  # nothing completed in the step (the router failed or refused every request): no per-request figure
        return [*lines, "  no request completed in the step: no per-request figures (see the router's log)"]
    for t in res["threads"]:
        if t["utime"] + t["stime"] == 0 and t["vcs"] == 0:
            continue
        lines.append(f"  thread {t['name']:<16} user {1e6 * t['utime'] / n:7.1f} us  sys {1e6 * t['stime'] / n:7.1f} us"
                     f"  vol. switches {t['vcs'] / n:5.2f}  invol. {t['nvcs'] / n:5.2f} per request")
    for w, rows in sorted(res.get("worker_threads", {}).items()):
        lines.append(f"  {w}: " + ", ".join(
            f"{t['name']} user {1e6 * t['utime'] / n:.1f} us sys {1e6 * t['stime'] / n:.1f} us "
            f"switches {t['vcs'] / n:.2f}" for t in rows if t["utime"] + t["stime"] > 0 or t["vcs"] > 0))
    ns = max(completed_rate * res.get("syscalls_s", 1.0), 1e-9)
    for th, calls in sorted(res.get("syscalls", {}).items()):
        top = sorted(((k, v) for k, v in calls.items() if k != "all"), key=lambda kv: -kv[1])[:10]
        lines.append(f"  syscalls {th}: {calls.get('all', 0) / ns:.2f} per request: "
                     + ", ".join(f"{k} {v / ns:.2f}" for k, v in top))
    bm = res.get("bus_messages")
    if bm:
        reqs = bm["out"].get("DecodeWork", 0) + bm["out"].get("PrefillWork", 0)
        for way in ("in", "out"):
            lines.append(f"  bus {way} per request ({reqs} requests in the strace window): " + ", ".join(
                f"{k} {v / max(reqs, 1):.2f}" for k, v in sorted(bm[way].items(), key=lambda kv: -kv[1])))
    p = res.get("perf", {})
    if "error" in p:
        lines.append(f"  perf: {p['error']}")
    else:
        lines.append("  perf samples by thread and object: "
                     + "; ".join(f"{s} {pct:.1f}%" for pct, s in p["by_thread_dso"][:14]))
        lines.append("  top symbols: " + "; ".join(f"{s} {pct:.1f}%" for pct, s in p["by_symbol"][:25]))
    return lines
