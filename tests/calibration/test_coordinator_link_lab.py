"""The link a coordinator pays to a worker, measured on the coordinator and stored per pair (issue 21): on the
lab, the path from the coordinator's host to the worker's is 40 ms slower than the console's own path to the
worker (tests/lab/delay_relay.py), and the calibration's pair figure sees that where the console's cannot;
the planner takes the pair's figure when that node coordinates, and the console's when the console does."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from calibration import link as calibrate_link
from calibration.store import store
from llamacpp.rpc_reach import handshakes_argv, parse_handshakes
from nodes.models import Transport
from nodes.pool import planner_nodes
from tests.deploy_fixtures import StepContext, lab_node, route_between
from tests.factories import NodeFactory

pytestmark = [pytest.mark.lab, pytest.mark.timeout(300), pytest.mark.django_db(transaction=True)]

DELAY_MS = 40.0


def test_the_coordinator_measures_its_own_link_to_the_worker_and_the_planner_uses_that_pair(lab, lab_hosts):
    coordinator_host, worker_host = lab_hosts(2)
    route_between([coordinator_host, worker_host])
    lab.delay_path(coordinator_host, worker_host, DELAY_MS)
    coordinator = lab_node(lab, coordinator_host, name="nas", may_coordinate=True)
    worker = lab_node(lab, worker_host, name="old-pc")
    console_host = NodeFactory(
        name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True
    )

    # The console's own view of the worker, the same way (TCP handshakes to its sshd), from here.
    seen = subprocess.run(
        handshakes_argv(worker.address, worker.ssh_port), capture_output=True, text=True, timeout=60
    )
    console_rtt = parse_handshakes(seen.stdout).rtt_ms
    assert console_rtt is not None and console_rtt < DELAY_MS / 2, seen.stdout

    ctx = StepContext({}, node=worker)
    pairs = asyncio.run(calibrate_link.from_coordinators(ctx, worker))
    # Only the node that may coordinate and is reached over SSH measured: the console's own host did not.
    assert set(pairs) == {str(coordinator.pk)}, (pairs, ctx.lines)
    pair_rtt = pairs[str(coordinator.pk)]["rtt_ms"]
    assert DELAY_MS <= pair_rtt < DELAY_MS + 60, ctx.lines
    assert any(f"link nas → old-pc: {pair_rtt:g} ms round trip" in line for line in ctx.lines)

    lines = store(worker, {"devices": {}, "link": {"rtt_ms": console_rtt}, "coordinator_links": pairs})
    assert f"link from coordinator nas {pair_rtt:.2f} ms round trip" in lines
    worker.refresh_from_db()
    stored = worker.coordinator_links[str(coordinator.pk)]
    assert stored["coordinator"] == "nas" and stored["source"] == "calibration"
    assert worker.link_rtt_from(coordinator) == pair_rtt

    # The planner: nas coordinating pays nas's own figure; the console's host coordinating pays the console's.
    by_nas = {n.name: n for n in planner_nodes([worker], coordinator)}
    by_console = {n.name: n for n in planner_nodes([worker], console_host)}
    assert by_nas["old-pc"].rtt_ms == pair_rtt
    assert by_console["old-pc"].rtt_ms == console_rtt
    assert by_nas["old-pc"].rtt_ms - by_console["old-pc"].rtt_ms > DELAY_MS / 2


def test_a_coordinator_that_cannot_reach_the_worker_is_named_and_left_out(lab, lab_hosts):
    coordinator_host, worker_host = lab_hosts(2)  # no route between the two hosts
    coordinator = lab_node(lab, coordinator_host, name="nas", may_coordinate=True)
    worker = lab_node(lab, worker_host, name="old-pc")
    ctx = StepContext({}, node=worker)
    assert asyncio.run(calibrate_link.from_coordinators(ctx, worker)) == {}
    assert any(
        line.startswith(
            f"link nas → old-pc not measured: nas cannot connect to {worker.address}:22 (connect:"
        )
        for line in ctx.lines
    ), ctx.lines
    assert worker.link_rtt_from(coordinator) is None
