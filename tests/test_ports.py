"""Ports picked for test and benchmark clusters stay out of the kernel's ephemeral range, where any
outgoing connection could take one before the service binds it (a CI failure: common/ports.py)."""

from __future__ import annotations

import socket

from common.ports import LOWEST, ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = ephemeral_low()
    ports = free_ports(12)
    assert len(set(ports)) == 12
    if low > LOWEST + 1000:
        assert all(LOWEST <= p < low for p in ports), (ports, low)
    for p in ports:  # free now: each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_held_port_is_never_picked() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_ports(1)[0]))
        mine = held.getsockname()[1]
        for _ in range(20):
            assert mine not in free_ports(50)
