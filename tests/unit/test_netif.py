"""troupe.runtime.netif, and how rank 0 picks its address for a job on several hosts (no process group)."""

from __future__ import annotations

import pytest

from troupe.runtime import launch, netif


def test_loopback_is_found_and_routes_to_itself():
    assert netif.addresses().get("lo") == "127.0.0.1"
    assert netif.source_address("127.0.0.1") == "127.0.0.1"
    assert netif.interface_for("127.0.0.1") == "lo"
    assert netif.interface_for("no-such-host.invalid") is None


def test_reachable_address_skips_addresses_every_host_has():
    own = [a for a in netif.addresses().values() if not netif.is_loopback(a)]
    # loopback and this host's own addresses (docker0's 172.17.0.1 is on every host) say nothing
    assert netif.reachable_address(["127.0.0.1", "127.0.1.1", *own]) is None
    try:
        expected = netif.source_address("203.0.113.7")
    except OSError:
        pytest.skip("no route off this host")
    assert netif.reachable_address(["127.0.0.1", *own, "203.0.113.7"]) == expected


def test_master_address_prefers_the_hostname_then_the_route(monkeypatch):
    monkeypatch.setattr(netif, "host_address", lambda: "10.0.0.1")
    assert launch._master_address([["10.0.0.2"]]) == "10.0.0.1"
    monkeypatch.setattr(netif, "host_address", lambda: None)
    seen = []
    monkeypatch.setattr(netif, "reachable_address", lambda peers: seen.extend(peers) or "10.0.0.9")
    assert launch._master_address([["127.0.0.1", "10.0.0.9"], ["10.0.0.2"]]) == "10.0.0.9"
    assert seen == ["127.0.0.1", "10.0.0.9", "10.0.0.2"]
    monkeypatch.setattr(netif, "reachable_address", lambda peers: None)
    with pytest.raises(RuntimeError, match="TROUPE_MASTER_ADDR"):
        launch._master_address([["127.0.0.1"]])


def test_gloo_interface_only_where_the_hostname_does_not_do(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(netif, "host_address", lambda: "10.0.0.1")
    launch._gloo_interface_towards("127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in launch.os.environ
    monkeypatch.setattr(netif, "host_address", lambda: None)
    launch._gloo_interface_towards("127.0.0.1")
    assert launch.os.environ["GLOO_SOCKET_IFNAME"] == "lo"
