"""The Windows probe's output (remote/powershell.py's `probe_script`) as a ProbeReport: pure, no Django.

Its sections are headed `@@@ <name>` as the POSIX probe's are: the CIM classes Win32_ComputerSystem,
Win32_Processor and Win32_OperatingSystem as ConvertTo-Json prints them (one object, or an array for a
machine with two processor sockets), nvidia-smi's CSV where it is installed (the same format as on Linux),
Get-NetTCPConnection's listeners of the RPC port as JSON, and the llama.cpp programs on the PATH.
"""

from __future__ import annotations

import json
import re

from llamacpp.args import BINARIES
from nodes.probe.parse import ProbeReport, _set_port_holder, add_cpu_and_nvidia_devices, split_sections
from remote.listeners import parse_get_nettcpconnection

KIB = 1024
# Win32_Processor.Architecture (the CIM documentation's values) as the console names architectures.
ARCHITECTURES = {0: "x86", 5: "arm", 9: "x86_64", 12: "arm64"}


def _json_rows(text: str) -> list[dict]:
    """ConvertTo-Json's output: one object, an array of them, or nothing."""
    text = text.strip()
    if not text:
        return []
    data = json.loads(text)
    rows = data if isinstance(data, list) else [data]
    return [row for row in rows if isinstance(row, dict)]


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_windows_binaries(text: str) -> dict[str, str]:
    """{name: path} from Get-Command's Source lines (C:\\llama\\ggml-rpc-server.exe → ggml-rpc-server)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        path = line.strip()
        name = re.split(r"[\\/]", path)[-1]
        if name.lower().endswith(".exe"):
            name = name[:-4]
        if name in BINARIES and re.match(r"[A-Za-z]:[\\/]", path):
            found.setdefault(name, path)
    return found


def build_windows_report(text: str, *, rpc_port: int) -> ProbeReport:
    sections = split_sections(text)
    report = ProbeReport(platform="windows", rpc_port=rpc_port)
    try:
        computer = _json_rows(sections.get("computer", ""))
        processors = _json_rows(sections.get("processor", ""))
        systems = _json_rows(sections.get("os", ""))
    except json.JSONDecodeError as exc:
        report.warnings.append(f"The Windows probe printed something that is not JSON: {exc}")
        computer, processors, systems = [], [], []
    system = systems[0] if systems else {}
    report.hostname = str(computer[0].get("Name", "")) if computer else ""
    report.os_name = str(system.get("Caption", "")).strip() or "Windows"
    report.kernel = str(system.get("Version", ""))
    report.cpu_model = str(processors[0].get("Name", "")).strip() if processors else ""
    report.cpu_cores = sum(_int(p.get("NumberOfLogicalProcessors")) for p in processors) or _int(
        computer[0].get("NumberOfLogicalProcessors") if computer else 0
    )
    # Threads per core from the physical count, so the servers get one thread per core (llamacpp/args.py).
    physical = sum(_int(p.get("NumberOfCores")) for p in processors)
    if physical and report.cpu_cores >= physical:
        report.cpu_threads_per_core = max(1, report.cpu_cores // physical)
    report.arch = ARCHITECTURES.get(_int(processors[0].get("Architecture", -1)), "") if processors else ""
    # Win32_ComputerSystem counts every byte installed; Win32_OperatingSystem what Windows may use, in KiB
    # (less what firmware and an integrated GPU reserve): the latter is the machine's RAM to plan on.
    total = _int(system.get("TotalVisibleMemorySize")) * KIB or (
        _int(computer[0].get("TotalPhysicalMemory")) if computer else 0
    )
    available = min(total, _int(system.get("FreePhysicalMemory")) * KIB)
    report.ram_total_bytes = report.ram_physical_bytes = total
    report.ram_available_bytes = available
    add_cpu_and_nvidia_devices(report, sections, total, available)
    try:
        _set_port_holder(report, parse_get_nettcpconnection(sections.get("listeners", "")))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        report.warnings.append(f"Get-NetTCPConnection printed something unexpected: {exc}")
    report.binaries = parse_windows_binaries(sections.get("binaries", ""))
    if not total:
        report.warnings.append("Windows reported no memory size (Win32_OperatingSystem).")
    if "end" not in sections:
        report.warnings.append("The probe output ended early; some facts may be missing.")
    return report
