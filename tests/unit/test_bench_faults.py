"""The fault harness's pieces that need no namespaces: the doc table it merges into, the
delayer's netlink messages, the matrix's definitions."""

import socket
import struct

from troupe.bench import delayer, netns
from troupe.bench import network_faults as faults


def test_doc_table_merges_cells_by_regime_and_fault_in_matrix_order(tmp_path):
    doc = tmp_path / "reliability.md"
    doc.write_text("# Reliability\n\ntext before\n")
    first = [faults.Cell("plain-2", "down-5s", "healed, bit-identical", recover=1.8, acc=0.84, baseline_acc=0.84,
                         fault_step=20),
             faults.Cell("plain-2", "none", "fault-free", acc=0.84)]
    faults.write_doc(doc, first, 100, 0.2, 0)
    faults.write_doc(doc, [faults.Cell("plain-2", "delay-200", "healed, bit-identical", acc=0.84, baseline_acc=0.84),
                           faults.Cell("hogwild-4", "none", "fault-free", acc=0.71)], 100, 0.2, 0)
    text = doc.read_text()
    assert text.startswith("# Reliability\n\ntext before\n") and text.count(faults.MARK_BEGIN) == 1
    rows = [line for line in text.splitlines() if line.startswith("| plain-2") or line.startswith("| hogwild-4")]
    assert [r.split("|")[2].strip() for r in rows] == ["none", "+200 ms delay with jitter, 10 s", "link down 5 s",
                                                      "none"]
    assert "| 20 | - | 1.8 s | 0.840 (0.840) |" in rows[2]


def test_every_fault_and_regime_is_well_formed():
    assert {"loss-1", "loss-10", "loss-30", "delay-200", "down-5s", "down", "partition-10s", "partition",
            "store-down-10s", "slow-100x", "intruder", "down-restart"} <= set(faults.FAULTS)
    assert faults.FAULTS["store-down-10s"].victim(4) == 0  # the rendezvous host
    assert faults.FAULTS["intruder"].victim(4) == 4  # the extra host, not in the job
    assert not faults.FAULTS["down-server"].only(faults.REGIMES["plain-4"])
    assert faults.FAULTS["down-server"].only(faults.REGIMES["downpour-4"])
    assert faults._workers(faults.REGIMES["downpour-4"]) == 2 and faults._workers(faults.REGIMES["hogwild-4"]) == 4


def test_delayer_speaks_nfnetlink_queue():
    bind = delayer._message(delayer.NFQNL_MSG_CONFIG, 7, delayer._attr(delayer.NFQA_CFG_CMD, b"\x01\x00\x00\x02"))
    length, kind, flags = struct.unpack_from("=IHH", bind)
    assert length == len(bind) == 16 + 4 + 8 and kind == (3 << 8) | 2 and flags == 1
    assert bind[16:20] == bytes([socket.AF_UNSPEC, 0, 0, 7])  # nfgenmsg: the queue number, big-endian
    # a packet message from the kernel: nlmsghdr, nfgenmsg, NFQA_PACKET_HDR (id 0x01020304), another attribute
    attrs = delayer._attr(delayer.NFQA_PACKET_HDR, struct.pack("!IHB", 0x01020304, 0x0800, 3)) + \
        delayer._attr(9, b"\0" * 6)
    body = struct.pack("=BBH", socket.AF_INET, 0, socket.htons(7)) + attrs
    message = struct.pack("=IHHII", 16 + len(body), (3 << 8) | 0, 0, 0, 0) + body
    assert list(delayer._packet_ids(message + message)) == [0x01020304, 0x01020304]


def test_netns_parses_delays():
    assert netns._ms("1ms") == 1.0 and netns._ms("2s") == 2000.0 and netns._ms("500us") == 0.5


def test_every_fault_method_is_callable_on_hosts_with_a_base_delay():
    hosts = netns.Hosts(2, rate="1gbit", delay="1ms")  # attributes set in __init__ must not shadow methods
    for name in ("lose", "add_delay", "slow", "link", "partition", "heal", "kill_all", "stacks"):
        assert callable(getattr(hosts, name)), name
