"""The Windows probe's output (remote/powershell.py's `probe_script`) as a ProbeReport: pure, no Django.

Its sections are headed `@@@ <name>` as the POSIX probe's are: the CIM classes Win32_ComputerSystem,
Win32_Processor and Win32_OperatingSystem as ConvertTo-Json prints them (one object, or an array for a
machine with two processor sockets), nvidia-smi's CSV where it is installed (the same format as on Linux),
Get-NetTCPConnection's listeners of the RPC port as JSON, and the llama.cpp programs on the PATH. Vulkan's
devices come from `vulkaninfo --summary`, whose format is the same as on Linux (nodes/probe/gpus.py reads
both), the GPUs' names and PCI IDs from Win32_VideoController (Intel and AMD GPUs have no nvidia-smi).
"""

from __future__ import annotations

import json
import re

from llamacpp.args import BINARIES
from nodes.probe.gpus import VENDORS, DrmCard, add_vulkan
from nodes.probe.parse import ProbeReport, _set_port_holder, add_cpu_and_nvidia_devices, split_sections
from remote.listeners import parse_get_nettcpconnection

KIB = 1024
# Win32_VideoController.AdapterRAM is a uint32: a figure this close to 4 GiB is a card with more (or wrapped).
ADAPTER_RAM_LIMIT = 3 * 1024**3
_PCI_ID = re.compile(r"PCI\\VEN_(?P<vendor>[0-9A-Fa-f]{4})&DEV_(?P<device>[0-9A-Fa-f]{4})")
# What brings vulkaninfo (and Vulkan itself) to a Windows PC: the GPU vendor's own driver.
WINDOWS_VULKAN = (
    "the GPU vendor's driver from intel.com, amd.com or nvidia.com, whose Vulkan runtime brings "
    "vulkaninfo.exe"
)
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


def video_controllers(rows: list[dict]) -> tuple[list[DrmCard], list[tuple[str, str]]]:
    """Win32_VideoController's adapters as (cards with their PCI IDs and VRAM where Windows states it,
    (vendor, name) of each GPU). AdapterRAM is a 32-bit count of bytes: a card with 4 GiB or more reads as
    about 4 GiB (or less, wrapped), so only a figure well under that is taken; the rest is left to the
    build's rpc-server banner, as on Linux without the amdgpu driver's files."""
    cards, gpus = [], []
    for number, row in enumerate(rows):
        match = _PCI_ID.search(str(row.get("PNPDeviceID") or ""))
        if not match:
            continue  # Microsoft's Basic Display Adapter, a remote-desktop adapter: no PCI device
        vendor_id, device_id = "0x" + match["vendor"].lower(), "0x" + match["device"].lower()
        ram = _int(row.get("AdapterRAM"))
        known = 0 < ram < ADAPTER_RAM_LIMIT
        cards.append(DrmCard(f"video{number}", vendor_id, device_id, ram if known else 0, 0))
        gpus.append(
            (VENDORS.get(vendor_id, str(row.get("AdapterCompatibility") or "")), str(row.get("Name", "")))
        )
    return cards, gpus


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
    nvidia = add_cpu_and_nvidia_devices(report, sections, total, available)
    try:
        controllers = _json_rows(sections.get("video", ""))
    except json.JSONDecodeError as exc:
        report.warnings.append(f"Win32_VideoController printed something that is not JSON: {exc}")
        controllers = []
    cards, gpus = video_controllers(controllers)
    add_vulkan(report, sections, cuda_or_rocm=bool(nvidia), cards=cards, gpus=gpus, packages=WINDOWS_VULKAN)
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
