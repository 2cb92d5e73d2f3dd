"""Hardware discovery: pure parsers of what the probe script (nodes/probe/script.py) prints (no Django).

One POSIX shell script (`PROBE_SCRIPT`) runs on the node in a single round trip and prints sections
headed `@@@ <name>`; it branches on `uname -s` itself, so Linux and macOS need no second trip. Its only
input, the RPC port, arrives as "$1". `build_report` turns the sections into a `ProbeReport` whose devices
are named as llama.cpp names them (CUDA0.., ROCm0.., Vulkan0.., MTL0, CPU).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from llamacpp.args import BINARIES, LLAMA_SERVER_BINARY, RPC_SERVER_BINARIES
from llamacpp.logs import parse_llama_version
from nodes.probe.bandwidth import apple_bandwidth, cpu_bandwidth, gpu_bandwidth
from nodes.probe.devices import DeviceInfo
from nodes.probe.gpus import add_vulkan, parse_gfx_targets
from nodes.probe.script import PROBE_SCRIPT
from nodes.probe.wsl import parse_wsl
from remote.listeners import Listener, holders_of, parse_lsof, parse_ss

__all__ = ["PROBE_SCRIPT", "DeviceInfo", "ProbeReport", "build_report", "parse_gfx_targets"]

MIB = 1024**2
SECTION = "@@@ "
# cgroup v1 reports "no limit" as a huge page-aligned number; anything above this is unlimited.
_UNLIMITED = 1 << 60


@dataclass
class ProbeReport:
    platform: str = "unknown"  # linux | macos | unknown
    hostname: str = ""
    os_name: str = ""
    kernel: str = ""
    arch: str = ""
    cpu_model: str = ""
    cpu_cores: int = 0
    # Hardware threads per physical core (2 with SMT/Hyper-Threading): llama.cpp's CPU threads are counted
    # in physical cores (llamacpp/args.py cpu_threads).
    cpu_threads_per_core: int = 1
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    memory_limit_bytes: int | None = None  # A container's cgroup limit, when there is one.
    ram_physical_bytes: int = 0  # The machine's RAM, whatever limit applies to the probe's cgroup.
    cpu_quota_cores: float | None = None  # A cgroup CPU quota in cores (0.25 = a quarter of one core).
    # The period the quota is granted per (ms): after a pause, a quota'd process starts at full speed.
    cpu_quota_period_ms: float | None = None
    devices: list[DeviceInfo] = field(default_factory=list)
    binaries: dict[str, str] = field(default_factory=dict)  # name -> path
    llama_version: str = ""
    llama_commit: str = ""
    # The AMD GPUs' compile targets (gfx1100, ...): a ROCm build compiles for these (builds/backends.py).
    amdgpu_targets: list[str] = field(default_factory=list)
    rpc_port: int | None = None
    rpc_port_pid: int | None = None
    rpc_port_process: str = ""
    rtt_ms: float | None = None
    # WSL: {"version": 2, "networking_mode": "nat", "address": "172.28.1.2"} (nodes/probe/wsl.py), or {}.
    wsl: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def rpc_port_in_use(self) -> bool:
        return bool(self.rpc_port_process or self.rpc_port_pid)

    @property
    def rpc_server_binary(self) -> str:
        """The RPC server's path: `ggml-rpc-server` in current releases, `rpc-server` in older ones."""
        return next((self.binaries[name] for name in RPC_SERVER_BINARIES if name in self.binaries), "")

    def facts(self) -> dict:
        """What a Node stores in `facts` (JSON; devices are rows of their own)."""
        data = asdict(self)
        data.pop("devices")
        data["rpc_port_in_use"] = self.rpc_port_in_use
        data["rpc_server_binary"] = self.rpc_server_binary
        data["llama_server_binary"] = self.binaries.get(LLAMA_SERVER_BINARY, "")
        return data


# -- sections -------------------------------------------------------------------------------------------


def split_sections(text: str) -> dict[str, str]:
    """{"uname": "...", "cpuinfo": "...", ...} from the probe script's output."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(SECTION):
            current = sections.setdefault(line[len(SECTION) :].strip(), [])
        elif current is not None:
            current.append(line)
    result = {name: "\n".join(lines).strip() for name, lines in sections.items()}
    if "files" in result:
        for name, text in _file_sections(result.pop("files")).items():
            result.setdefault(name, text)
    return result


# Which file of the Linux `head -v` block feeds which section; the first existing match wins (the
# probe lists the process's own cgroup before the hierarchy's root).
_FILE_SECTIONS = [
    ("os-release", "/etc/os-release"),
    ("cpuinfo", "/proc/cpuinfo"),
    ("meminfo", "/proc/meminfo"),
    ("status", "/proc/self/status"),
    ("osrelease", "/proc/sys/kernel/osrelease"),
    ("proc-version", "/proc/version"),
    ("cgroup-v2-max", "/memory.max"),
    ("cgroup-v2-current", "/memory.current"),
    ("cgroup-v1-limit", "/memory.limit_in_bytes"),
    ("cgroup-v1-usage", "/memory.usage_in_bytes"),
    ("cgroup-stat", "/memory.stat"),
    ("cgroup-v2-cpu-max", "/cpu.max"),
    ("cgroup-v1-cpu-quota", "/cpu.cfs_quota_us"),
    ("cgroup-v1-cpu-period", "/cpu.cfs_period_us"),
]


def _file_sections(text: str) -> dict[str, str]:
    """`head -v a b c` output → {"cpuinfo": ..., "cgroup-v2-max": ..., "nproc": ...}."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        match = re.fullmatch(r"==> (.+) <==", line)
        if match:
            blocks.append((match.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
    result: dict[str, str] = {}
    for path, lines in blocks:
        for name, suffix in _FILE_SECTIONS:
            if path.endswith(suffix) and name not in result:
                result[name] = "\n".join(lines).strip()
                break
    allowed = re.search(r"^Cpus_allowed_list:\s*(\S+)", result.pop("status", ""), flags=re.M)
    if allowed:
        result["nproc"] = str(count_cpu_list(allowed.group(1)))
    return result


def count_cpu_list(text: str) -> int:
    """ "0-3,8,10-11" → 7 (the kernel's CPU list format)."""
    total = 0
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            total += (int(high) - int(low) + 1) if high.isdigit() else 1
    return total


# -- Linux ----------------------------------------------------------------------------------------------


def parse_uname(text: str) -> tuple[str, str, str]:
    """`uname -srm` → (system, kernel release, machine)."""
    parts = text.split()
    if len(parts) < 3:
        return (parts[0] if parts else "", parts[1] if len(parts) > 1 else "", "")
    return parts[0], parts[1], parts[-1]


def parse_os_release(text: str) -> dict[str, str]:
    result = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and not key.startswith("#"):
            result[key.strip()] = value.strip().strip('"').strip("'")
    return result


def parse_cpuinfo(text: str) -> tuple[str, int]:
    """(CPU model, logical CPU count). x86 says "model name"; Arm boards say "Model" or nothing."""
    model, count = "", 0
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "processor" and value.isdigit():
            count += 1
        fields.setdefault(key, value)
    for key in ("model name", "cpu model", "model", "hardware", "cpu part"):
        if fields.get(key) and not (key == "model" and fields[key].isdigit()):
            model = fields[key]
            break
    return model, count


def threads_per_core(cpuinfo: str) -> int:
    """Hardware threads per physical core from /proc/cpuinfo's `siblings` (threads per package) over its
    `cpu cores` (cores per package); 1 where it says neither (Arm boards)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    siblings, cores = fields.get("siblings", ""), fields.get("cpu cores", "")
    if siblings.isdigit() and cores.isdigit() and int(cores) > 0 and int(siblings) >= int(cores):
        return max(1, int(siblings) // int(cores))
    return 1


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; old kernels without MemAvailable: free + buffers + cached."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+(?:\(\w+\))?):\s+(\d+)(?:\s+kB)?", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    total = values.get("MemTotal", 0)
    available = values.get("MemAvailable")
    if available is None:
        available = values.get("MemFree", 0) + values.get("Buffers", 0) + values.get("Cached", 0)
    return total, available


def parse_cgroup_bytes(text: str) -> int | None:
    """A cgroup memory file's value: None for "max", empty, or v1's effectively-unlimited number."""
    text = text.strip()
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def file_cache_bytes(stat: str) -> int:
    """The group's page cache of files, which the kernel drops when a process needs the room, from its
    memory.stat: v1 names the hierarchical sums `total_active_file` and `total_inactive_file`, v2 `file`;
    0 when the file was not readable."""
    values = {key: int(value) for key, value in re.findall(r"^(\w+) (\d+)$", stat, flags=re.M)}
    if "total_active_file" in values or "total_inactive_file" in values:
        return values.get("total_active_file", 0) + values.get("total_inactive_file", 0)
    return values.get("active_file", 0) + values.get("inactive_file", 0)


def cgroup_memory(sections: dict[str, str]) -> tuple[int | None, int | None]:
    """(limit, usage without the file cache) of the cgroup the probe ran in; v2 wins when both answer.

    A group's usage includes every file page its processes read (a model file a llama-server mapped, one
    just copied there): that cache is given up as soon as a process needs the room, as MemAvailable counts
    it outside containers, so usage alone would report a warm machine as full."""
    limit = parse_cgroup_bytes(sections.get("cgroup-v2-max", ""))
    usage_key = "cgroup-v2-current"
    if limit is None:
        limit = parse_cgroup_bytes(sections.get("cgroup-v1-limit", ""))
        usage_key = "cgroup-v1-usage"
    if limit is None:
        return None, None
    usage = parse_cgroup_bytes(sections.get(usage_key, ""))
    if usage is not None:
        usage = max(0, usage - file_cache_bytes(sections.get("cgroup-stat", "")))
    return limit, usage


def _cgroup_quota_and_period_us(sections: dict[str, str]) -> tuple[int, int] | None:
    parts = sections.get("cgroup-v2-cpu-max", "").split()
    if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]):
        return int(parts[0]), int(parts[1])
    quota = sections.get("cgroup-v1-cpu-quota", "").strip()
    period = sections.get("cgroup-v1-cpu-period", "").strip()
    if quota.isdigit() and period.isdigit() and int(period):
        return int(quota), int(period)
    return None


def cgroup_cpu_quota(sections: dict[str, str]) -> float | None:
    """The CPU quota of the probe's cgroup in cores (v2 `cpu.max` "QUOTA PERIOD", v1 cfs_quota_us and
    cfs_period_us); None when there is none ("max", -1) or it cannot be read."""
    found = _cgroup_quota_and_period_us(sections)
    return round(found[0] / found[1], 4) if found else None


def cgroup_cpu_period_ms(sections: dict[str, str]) -> float | None:
    """The period that quota is granted per, in ms (None without a quota)."""
    found = _cgroup_quota_and_period_us(sections)
    return round(found[1] / 1000, 3) if found else None


def parse_nvidia_smi(text: str) -> list[tuple[int, str, int, int]]:
    """`--query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits` (MiB) →
    [(index, name, total bytes, free bytes)]. Error text (no driver) yields no GPUs."""
    gpus = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        index, name, total, free = parts
        if not (total.isdigit() and free.isdigit()):
            continue  # "[N/A]" on some boards.
        gpus.append((int(index), name, int(total) * MIB, int(free) * MIB))
    return sorted(gpus)


def parse_rocm_smi(text: str) -> list[tuple[int, str, int, int]]:
    """rocm-smi's product name and VRAM, as JSON (`--json`) or its classic text → same tuples as nvidia."""
    cards: dict[int, dict[str, str]] = {}
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return []
        for key, values in data.items():
            match = re.fullmatch(r"card(\d+)", key)
            if match and isinstance(values, dict):
                cards[int(match.group(1))] = {k: str(v) for k, v in values.items()}
    else:
        for match in re.finditer(r"^GPU\[(\d+)\]\s*:\s*([^:]+?):\s*(.*)$", text, flags=re.M):
            cards.setdefault(int(match.group(1)), {})[match.group(2).strip()] = match.group(3).strip()
    gpus = []
    for index, values in sorted(cards.items()):
        total = _digits(values.get("VRAM Total Memory (B)"))
        used = _digits(values.get("VRAM Total Used Memory (B)")) or 0
        if not total:
            continue
        name = values.get("Card Series") or values.get("Card series") or values.get("Card model") or "AMD GPU"
        gpus.append((index, name, total, max(0, total - used)))
    return gpus


def _digits(value: str | None) -> int | None:
    return int(value) if value and value.strip().isdigit() else None


# -- macOS ----------------------------------------------------------------------------------------------


def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl a b c` prints "a: value" lines."""
    result = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            result[key.strip()] = value.strip()
    return result


def parse_sw_vers(text: str) -> str:
    values = parse_sysctl(text)
    return " ".join(v for v in (values.get("ProductName", ""), values.get("ProductVersion", "")) if v)


def parse_vm_stat(text: str) -> int | None:
    """Reclaimable memory in bytes: free + inactive + speculative pages (what macOS can hand out soon)."""
    page = re.search(r"page size of (\d+) bytes", text)
    if not page:
        return None
    pages = {
        k.strip().lower(): int(v) for k, v in re.findall(r"^Pages ([\w ]+):\s+(\d+)\.", text, flags=re.M)
    }
    free = sum(pages.get(name, 0) for name in ("free", "inactive", "speculative"))
    return free * int(page.group(1))


def parse_displays(text: str) -> list[dict[str, str]]:
    """`system_profiler SPDisplaysDataType` → one dict per GPU ("Chipset Model", "Metal Support", ...)."""
    gpus: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Chipset Model:"):
            current = {"Chipset Model": stripped.split(":", 1)[1].strip()}
            gpus.append(current)
        elif current is not None and ":" in stripped and not stripped.endswith(":"):
            key, value = stripped.split(":", 1)
            current.setdefault(key.strip(), value.strip())
    return gpus


# -- llama.cpp --------------------------------------------------------------------------------------------


def parse_binaries(sections: dict[str, str]) -> dict[str, str]:
    """{name: path}: the first path listed for each llama.cpp binary (the PATH comes before the cache)."""
    found = {name: path for name in BINARIES if (path := sections.get(f"bin {name}", "").strip())}
    for line in sections.get("binaries", "").splitlines():
        path = line.strip()
        name = path.rsplit("/", 1)[-1]
        if name in BINARIES and path.startswith("/"):
            found.setdefault(name, path)
    return found


# -- the report ---------------------------------------------------------------------------------------------


def parse_wired_limit(values: dict[str, str]) -> int | None:
    """The Metal wired limit from sysctl, in bytes; None when it is macOS's default (0) or unknown.

    macOS 14 and later name it iogpu.wired_limit_mb (MiB); macOS 13 named it debug.iogpu.wired_limit and
    counted bytes."""
    for key, unit in (("iogpu.wired_limit_mb", MIB), ("debug.iogpu.wired_limit", 1)):
        value = values.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value) * unit
    return None


def add_cpu_and_nvidia_devices(
    report: ProbeReport, sections: dict[str, str], total: int, available: int
) -> list:
    """The CPU device (its RAM, a table bandwidth until calibration) and the NVIDIA GPUs nvidia-smi listed:
    the same on every platform's probe (Linux, macOS, Windows)."""
    gbs, why = cpu_bandwidth(report.cpu_model)
    report.devices.append(
        DeviceInfo("CPU", "cpu", report.cpu_model or "CPU", total, available, bandwidth_gbs=gbs)
    )
    report.warnings.append(f"CPU bandwidth {gbs:g} GB/s is an estimate ({why}).")
    nvidia = sections.get("nvidia-smi", "")
    gpus = parse_nvidia_smi(nvidia)
    if nvidia and not gpus:
        report.warnings.append(f"nvidia-smi is installed but reported no GPU: {nvidia.splitlines()[0][:200]}")
    for index, name, total_b, free_b in gpus:
        report.devices.append(
            DeviceInfo(f"CUDA{index}", "cuda", name, total_b, free_b, False, gpu_bandwidth(name))
        )
    return gpus


def build_report(text: str, *, rpc_port: int) -> ProbeReport:
    """Everything the probe script printed, as a report with llama.cpp-named devices."""
    sections = split_sections(text)
    system, kernel, arch = parse_uname(sections.get("uname", ""))
    report = ProbeReport(hostname=sections.get("hostname", ""), kernel=kernel, arch=arch, rpc_port=rpc_port)
    report.binaries = parse_binaries(sections)
    report.llama_version, report.llama_commit = parse_llama_version(sections.get("llama-server-version", ""))
    if system == "Darwin":
        _fill_macos(report, sections)
    elif system == "Linux":
        _fill_linux(report, sections)
    else:
        report.warnings.append(
            f"Unsupported system {system or 'unknown'!r}: only Linux and macOS are probed."
        )
    if "end" not in sections:
        report.warnings.append("The probe output ended early; some facts may be missing.")
    return report


def _fill_linux(report: ProbeReport, sections: dict[str, str]) -> None:
    report.platform = "linux"
    os_release = parse_os_release(sections.get("os-release", ""))
    report.os_name = os_release.get("PRETTY_NAME") or os_release.get("NAME", "Linux")
    report.cpu_model, report.cpu_cores = parse_cpuinfo(sections.get("cpuinfo", ""))
    report.cpu_threads_per_core = threads_per_core(sections.get("cpuinfo", ""))
    if sections.get("nproc", "").isdigit():
        # nproc honours CPU affinity (containers pinned to some cores); cpuinfo lists the whole machine.
        report.cpu_cores = int(sections["nproc"])
    total, available = parse_meminfo(sections.get("meminfo", ""))
    report.ram_physical_bytes = total
    limit, usage = cgroup_memory(sections)
    if limit is not None and limit < total:
        # A container sees the host's /proc/meminfo; what it may use is its cgroup limit.
        report.memory_limit_bytes = limit
        total = limit
        available = min(available, max(0, limit - (usage or 0)))
    report.ram_total_bytes, report.ram_available_bytes = total, available
    report.wsl = parse_wsl(sections, report.kernel)
    if report.wsl.get("version") == 2 and report.wsl.get("networking_mode") != "mirrored":
        report.warnings.append(
            "This is WSL2 behind Windows' NAT: other machines reach it only through a port forward on the "
            "Windows side, or with mirrored networking (its node page has the lines to run)."
        )
    report.cpu_quota_cores = cgroup_cpu_quota(sections)
    report.cpu_quota_period_ms = cgroup_cpu_period_ms(sections)
    if report.cpu_quota_cores is not None:
        report.warnings.append(
            f"A CPU quota limits this node to {report.cpu_quota_cores:g} cores' worth of time: calibrate it "
            "to measure what that leaves."
        )
    gpus = add_cpu_and_nvidia_devices(report, sections, total, available)
    amd = parse_rocm_smi(sections.get("rocm-smi", ""))
    for index, name, total_b, free_b in amd:
        report.devices.append(
            DeviceInfo(f"ROCm{index}", "rocm", name, total_b, free_b, False, gpu_bandwidth(name))
        )
    if amd:
        report.amdgpu_targets = parse_gfx_targets(sections.get("rocm-smi", ""), sections.get("kfd", ""))
    add_vulkan(report, sections, cuda_or_rocm=bool(gpus or amd))
    _set_port_holder(report, parse_ss(sections.get("listeners", "")))


def _fill_macos(report: ProbeReport, sections: dict[str, str]) -> None:
    report.platform = "macos"
    report.os_name = parse_sw_vers(sections.get("sw_vers", "")) or "macOS"
    values = parse_sysctl(sections.get("sysctl", ""))
    report.cpu_model = values.get("machdep.cpu.brand_string", "")
    report.cpu_cores = int(values.get("hw.ncpu", "0") or 0)
    physical = int(values.get("hw.physicalcpu", "0") or 0)
    if 0 < physical < report.cpu_cores:
        report.cpu_threads_per_core = report.cpu_cores // physical
    total = int(values.get("hw.memsize", "0") or 0)
    reclaimable = parse_vm_stat(sections.get("vm_stat", ""))
    report.ram_total_bytes = total
    report.ram_available_bytes = min(total, reclaimable) if reclaimable is not None else total
    _set_port_holder(report, parse_lsof(sections.get("listeners", "")))
    gpus = parse_displays(sections.get("displays", ""))
    apple = next((g for g in gpus if g["Chipset Model"].startswith("Apple")), None)
    if apple is None and not report.cpu_model.startswith("Apple"):
        # An Intel Mac: llama.cpp's Metal path is not used there; plan it as a CPU machine.
        gbs, why = cpu_bandwidth(report.cpu_model)
        report.devices.append(
            DeviceInfo("CPU", "cpu", report.cpu_model, total, report.ram_available_bytes, bandwidth_gbs=gbs)
        )
        report.warnings.append(f"CPU bandwidth {gbs:g} GB/s is an estimate ({why}).")
        return
    chip = apple["Chipset Model"] if apple else report.cpu_model
    cores = apple.get("Total Number of Cores", "") if apple else ""
    description = f"{chip} ({cores}-core GPU)" if cores else chip
    # Raw unified memory and the wired limit: the planner alone decides the usable share (the clamp, the
    # wired limit). Free is all of it: Metal's own "free" is its working-set limit minus what it holds, and
    # macOS pages out or compresses other programs' memory to make room, so their pages limit nothing.
    # This one device is the whole Mac: its CPU draws on the same memory (the planner knows).
    report.devices.append(
        DeviceInfo(
            "MTL0",
            "metal",
            description,
            total,
            total,
            unified_memory=True,
            bandwidth_gbs=apple_bandwidth(chip),
            wired_limit_bytes=parse_wired_limit(values),
        )
    )


def _set_port_holder(report: ProbeReport, listeners: list[Listener]) -> None:
    """Who holds the RPC port, if anyone: the first holder's PID and name (ss shows no PID for another
    user's process)."""
    holders = holders_of(listeners, report.rpc_port or 0)
    if holders:
        report.rpc_port_pid = holders[0].pid
        report.rpc_port_process = holders[0].name or "unknown (not visible to this user)"
