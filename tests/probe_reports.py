"""Probe reports from the recorded outputs of real tools (tests/data/probe/)."""

from __future__ import annotations

from nodes.probe import parse as probe
from tests.paths import DATA

PROBE_DATA = DATA / "probe"


def report_of(name: str, **options) -> probe.ProbeReport:
    return probe.build_report(recorded(name), rpc_port=options.pop("rpc_port", 50052), **options)


def recorded(name: str) -> str:
    return (PROBE_DATA / name).read_text()
