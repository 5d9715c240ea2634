"""bench/router_account.py's readers: perf stat's per-thread syscall counts, and the bus messages by
type in an strace log (their msgspec tag, its length byte escaped as strace writes it)."""

from __future__ import annotations

from bench.router_account import bus_messages, parse_perf_per_thread, summary


def test_perf_stat_per_thread_lines_are_read_by_thread_and_syscall() -> None:
    text = """# started on Mon Dec  7 02:19:49 2026

python-32695,61931,,raw_syscalls:sys_enter,1876733831,100.00,,
ZMQbg/IO/0-32697,33583,,raw_syscalls:sys_enter,154340944,100.00,,
ZMQbg/Reaper-32696,<not counted>,,raw_syscalls:sys_enter,0,100.00,,
python-32695,5017,,syscalls:sys_enter_read,1876733831,100.00,,
python-32695,0,,syscalls:sys_enter_futex,1876733831,100.00,,
ZMQbg/IO/0-32697,812,,syscalls:sys_enter_getpid,154340944,100.00,,
"""
    assert parse_perf_per_thread(text) == {"python-32695": {"all": 61931, "read": 5017},
                                           "ZMQbg/IO/0-32697": {"all": 33583, "getpid": 812}}


def test_bus_messages_are_counted_by_type_and_direction() -> None:
    log = "\n".join([
        r'32697 sendto(9, "\0\0\1\202\244type\252DecodeWork\244rid", 40, 0, NULL, 0) = 40',
        r'32697 recvfrom(10, "\1\0\202\244type\252TokenBatch\1\202\244type\257DecodeHeartbeat", 8192, 0, '
        r'NULL, NULL) = 60',
        r'32697 read(11, "x\244type\xaaTokenBatch", 8192) = 20',
        r'32697 write(12, "\1\0\0\0\0\0\0\0", 8) = 8',
        '32697 recvfrom(10, 0x7f00, 8192, 0, NULL, NULL) = -1 EAGAIN (Resource temporarily unavailable)',
    ])
    got = bus_messages(log)
    assert got["out"] == {"DecodeWork": 1}
    assert got["in"] == {"TokenBatch": 2, "DecodeHeartbeat": 1}


def test_a_step_with_no_completed_request_says_so_instead_of_dividing_by_zero() -> None:
    res = {"threads_s": 5.0, "threads": [{"name": "python", "utime": 1.0, "stime": 0.1, "vcs": 10, "nvcs": 1}],
           "syscalls_s": 5.0, "syscalls": {"python": {"all": 100, "poll": 50}}, "perf": {"error": "no perf"}}
    lines = summary(res, 0.0)
    assert "no request completed" in lines[-1] and len(lines) == 2
    assert any("per request" in line for line in summary(res, 10.0))
