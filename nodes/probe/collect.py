"""Running the hardware probe on a node and storing what it found.

`collect` talks to the node through any transport (one round trip for the facts, a few tiny ones for the
round-trip time); `apply_probe_report` writes the result to the Node and its Device rows in one transaction.
"""

from __future__ import annotations

import os
import time

import psutil
from django.db import transaction
from django.utils import timezone

from nodes.models import LAST_ERROR_LIMIT, Device, Node, Reachability
from nodes.probe.parse import LLAMA_SERVER_BINARY, PROBE_SCRIPT, DeviceInfo, ProbeReport, build_report
from nodes.probe.windows import build_windows_report
from remote.base import TransportError
from remote.local import LocalTransport
from remote.powershell import powershell_argv, probe_script
from remote.text import printable, printable_json

PROBE_TIMEOUT_S = 120.0
RTT_SAMPLES = 3


class ProbeUnsupported(Exception):
    """The node's platform cannot be probed as it is set up. The message says what to do instead."""


async def collect(
    transport,
    platform_hint: str = "auto",
    *,
    rpc_port: int = 50052,
    timeout: float = PROBE_TIMEOUT_S,
    known_server: tuple[str, str] | None = None,
) -> ProbeReport:
    """Probe the node behind `transport` and return its report (nothing is stored here).

    `known_server` is (llama-server path, its version) from the node's build record: that binary is not
    started again just to print a version the console has (it is the costliest part of a probe)."""
    windows = getattr(transport, "shell", "posix") == "windows"
    if platform_hint == "windows" and not windows:
        raise ProbeUnsupported(
            "This node is set to Windows, but its SSH server answered with a POSIX shell (WSL, Cygwin or "
            "Git Bash as OpenSSH's default shell?). Set its platform to Linux for a WSL2 install, or make "
            "PowerShell or cmd.exe the default shell of Windows' OpenSSH server."
        )
    local = isinstance(transport, LocalTransport)
    # The SSH transport times its TCP handshake (a pure network round trip), the local one says 0; others
    # fall back to timing a trivial command, which also counts a process start on the node.
    rtt_ms = transport.rtt_ms
    if rtt_ms is None:
        rtt_ms = await measure_rtt(transport)
    if windows:
        report = await _collect_windows(transport, rpc_port, timeout, rtt_ms)
        if platform_hint in ("linux", "macos"):
            # The shell that answered decides which commands the node gets (Node.platform), not the setting.
            report.warnings.append(
                f"This node is set to {platform_hint}, but its SSH server answered with "
                f"{getattr(transport, 'windows_shell', '') or 'a Windows shell'}: it is treated as the "
                "Windows PC it is. Set its platform to Windows (or Detect) to match."
            )
        return report
    known_path, known_version = known_server or ("", "")
    argv = ["sh", "-c", PROBE_SCRIPT, "sh", str(int(rpc_port)), known_path]
    result = await transport.run(argv, timeout=timeout)
    if result.exit_status != 0:
        tail = "; ".join(line.text for line in result.lines[-3:])
        raise TransportError(f"The probe script failed with exit status {result.exit_status}: {tail}")
    report = build_report(result.stdout, rpc_port=rpc_port)
    report.rtt_ms = rtt_ms
    if known_path and not report.llama_version and report.binaries.get(LLAMA_SERVER_BINARY) == known_path:
        report.llama_version = known_version
    if local:
        _fill_from_psutil(report)
    return report


async def _collect_windows(transport, rpc_port: int, timeout: float, rtt_ms: float) -> ProbeReport:
    """A Windows node (its transport found PowerShell or cmd.exe behind its sshd): one PowerShell script."""
    result = await transport.run(powershell_argv(probe_script(rpc_port)), timeout=timeout)
    if result.exit_status != 0:
        tail = "; ".join(line.text for line in result.lines[-3:])
        raise TransportError(f"The Windows probe failed with exit status {result.exit_status}: {tail}")
    report = build_windows_report(result.stdout, rpc_port=rpc_port)
    report.rtt_ms = rtt_ms
    return report


async def measure_rtt(transport, samples: int = RTT_SAMPLES) -> float:
    """The fastest of a few trivial commands, in ms: a channel open, exec and exit on the node."""
    best = float("inf")
    for _ in range(samples):
        start = time.perf_counter()
        await transport.run(["true"], timeout=30)
        best = min(best, (time.perf_counter() - start) * 1000)
    return round(best, 2)


def _fill_from_psutil(report: ProbeReport) -> None:
    """The console's own host: memory and cores straight from psutil (the port holder comes from the
    probe script's `ss`/`lsof`, as on every node)."""
    memory = psutil.virtual_memory()
    total, available = memory.total, memory.available
    if report.memory_limit_bytes is not None:
        total = min(total, report.ram_total_bytes)
        available = min(available, report.ram_available_bytes)
    report.ram_total_bytes, report.ram_available_bytes = total, available
    report.cpu_cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else psutil.cpu_count()
    )
    for device in report.devices:
        # An integrated GPU stands for the system's RAM (nodes/probe/gpus.py): the same figures.
        if device.kind == "cpu" or (device.kind == "vulkan" and device.unified_memory):
            device.total_bytes, device.free_bytes = total, available


# What the probe reports is whatever the node printed (a fake nvidia-smi on its PATH can print anything): it
# is cleaned (remote/text.py) before it is stored, each string cut to what its place holds.
DESCRIPTION_LIMIT = 200  # Device.description
FACT_LIMITS = {
    "hostname": 253,
    "os_name": 200,
    "kernel": 200,
    "arch": 64,
    "cpu_model": 200,
    "llama_version": 200,
    "llama_commit": 64,
    "rpc_port_process": 200,
}


def stored_facts(report: ProbeReport) -> dict:
    """The report's facts as a Node stores them: printable strings only (paths and warnings up to
    JSON_STRING_LIMIT characters, the named facts up to their FACT_LIMITS)."""
    facts = printable_json(report.facts())
    for key, limit in FACT_LIMITS.items():
        if isinstance(facts.get(key), str):
            facts[key] = printable(facts[key], limit)
    return facts


def _device_fields(info: DeviceInfo) -> dict:
    return {
        "kind": info.kind,
        "description": printable(info.description, DESCRIPTION_LIMIT),
        "total_bytes": info.total_bytes,
        "free_bytes": info.free_bytes,
        "unified_memory": info.unified_memory,
        "bandwidth_gbs": info.bandwidth_gbs,
        "wired_limit_bytes": info.wired_limit_bytes,
    }


def apply_probe_report(node: Node, report: ProbeReport) -> list[Device]:
    """Store a successful probe: node facts and reachability, and the devices it found (added, updated
    or removed). Operator bandwidth overrides and measured figures of devices that remain are kept."""
    now = timezone.now()
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        existing = {device.name: device for device in locked.devices.all()}
        seen = set()
        for info in report.devices:
            seen.add(info.name)
            device = existing.get(info.name)
            if device is None:
                Device.objects.create(node=locked, name=info.name, **_device_fields(info))
                continue
            for field, value in _device_fields(info).items():
                setattr(device, field, value)
            device.save(update_fields=[*_device_fields(info), "updated_at"])
        gone = [name for name in existing if name not in seen]
        if gone:
            locked.devices.filter(name__in=gone).delete()
        locked.mark_back_online()  # after an outage: its one audit entry
        node.unreachable_since = None
        node.reachability = Reachability.REACHABLE
        node.last_seen_at = node.last_probe_at = now
        node.facts = stored_facts(report)
        node.rtt_ms = report.rtt_ms
        node.last_error = ""
        node.save(
            update_fields=["reachability", "last_seen_at", "last_probe_at", "facts", "rtt_ms", "last_error"]
        )
    return list(node.devices.all())


def record_probe_failure(node: Node, message: str, *, reachability: str | None = None) -> None:
    """A probe that could not finish: keep the devices (last known), mark the node and say why."""
    if reachability == Reachability.UNREACHABLE:
        node.mark_unreachable(message, probed=True)  # offline since now, audited once, if it answered before
        return
    node.last_probe_at = timezone.now()
    node.last_error = printable(message, LAST_ERROR_LIMIT, lines=True)
    fields = ["last_probe_at", "last_error"]
    if reachability:
        node.reachability = reachability
        fields.append("reachability")
    node.save(update_fields=fields)
