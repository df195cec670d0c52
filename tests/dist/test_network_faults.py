"""Network faults on simulated hosts (network namespaces), a subset of `troupe bench faults`:
packet loss and a short link outage heal bit-identically; a permanent partition is named on
every rank within the stated bound. Needs root and iproute2 (iptables for the loss); skipped
with the reason elsewhere."""

import random

import pytest

from troupe.bench import netns
from troupe.bench import network_faults as faults

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(bool(netns.available()), reason=f"simulated hosts: {netns.available()}")]

STEPS, PACE = 30, 0.1
TIMEOUTS = (20.0, 6.0)
"""TROUPE_TIMEOUT and TROUPE_PEER_TIMEOUT: short, so a permanent fault is named within seconds."""
REGIME = faults.REGIMES["plain-2"]


@pytest.fixture(scope="module")
def hosts_and_baseline(tmp_path_factory):
    work = tmp_path_factory.mktemp("netfaults")
    with netns.Hosts(2, rate=faults.RATE) as hosts:
        baseline = faults.run_cell(hosts, REGIME, None, STEPS, PACE, work / "none", None, random.Random(0), print,
                                   TIMEOUTS)
        assert baseline.outcome == "fault-free", (work / "none" / "output.txt").read_text()[-3000:]
        assert len(baseline.digests) == 2 and len(set(baseline.digests)) == 1  # ranks agree
        yield hosts, baseline, work
    assert netns.leftover() == []


def run(hosts_and_baseline, fault: faults.Fault) -> faults.Cell:
    hosts, baseline, work = hosts_and_baseline
    cell = faults.run_cell(hosts, REGIME, fault, STEPS, PACE, work / fault.name, baseline, random.Random(1), print,
                           TIMEOUTS)
    print(cell.row(), "\n", (work / fault.name / "output.txt").read_text()[-2000:])
    return cell


@pytest.mark.timeout(240)
@pytest.mark.skipif(bool(netns.loss_available()), reason=f"packet loss: {netns.loss_available()}")
def test_packet_loss_heals_bit_identically(hosts_and_baseline):
    cell = run(hosts_and_baseline, faults.Fault("loss-20-3s", "20% loss, 3 s", lambda h, v: h.lose(v, 20), 3.0))
    assert cell.outcome.endswith("bit-identical"), cell
    assert cell.digests == hosts_and_baseline[1].digests


@pytest.mark.timeout(240)
def test_short_link_outage_heals_bit_identically(hosts_and_baseline):
    cell = run(hosts_and_baseline, faults.Fault("down-3s", "link down 3 s", lambda h, v: h.link(v, up=False), 3.0))
    assert cell.outcome == "healed, bit-identical", cell
    assert cell.recover is not None and cell.recover < 10.0  # TCP's retransmission after the link is back


@pytest.mark.timeout(240)
def test_permanent_partition_is_named_on_every_rank_within_the_bound(hosts_and_baseline):
    hosts, _, work = hosts_and_baseline
    cell = run(hosts_and_baseline, faults.FAULTS["partition"])
    assert cell.outcome == "named and ended", cell
    # the bound: TROUPE_PEER_TIMEOUT after the last heartbeat got through, plus a store call's
    # deadline (3 s), the heartbeat period and process teardown
    assert cell.detect is not None and cell.detect < TIMEOUTS[1] + 12.0, cell
    output = (work / "partition" / "output.txt").read_text()
    assert "[host 0] troupe: rank 0 stopping" in output and "rank(s) [1] sent no heartbeat" in output
    assert "[host 1] troupe: rank 1 stopping" in output and "rendezvous at 10.78.0.1" in output
    assert "has been unreachable" in output
