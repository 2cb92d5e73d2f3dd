"""The Windows probe's output read into a report: recorded CIM values of a real Windows 11 PC (as
ConvertTo-Json prints them), nvidia-smi's CSV as Windows' driver prints it (the same format as on Linux),
and Get-NetTCPConnection's JSON. tests/lab/test_windows_lab.py runs the probe through real SSH."""

from __future__ import annotations

import json

from nodes.probe.windows import build_windows_report, parse_windows_binaries
from remote.powershell import probe_script
from tests.paths import DATA

CIM = json.loads((DATA / "probe" / "windows11_ryzen_cim.json").read_text())
GIB = 1024**3


def _output(
    *,
    nvidia: str = "",
    listeners: str = "",
    binaries: str = "",
    two_sockets: bool = False,
    vulkaninfo: str = "",
    video=None,
) -> str:
    processor = CIM["Win32_Processor"]
    sections = {
        "computer": json.dumps(CIM["Win32_ComputerSystem"], separators=(",", ":")),
        "processor": json.dumps([processor, processor] if two_sockets else processor),
        "os": json.dumps(CIM["Win32_OperatingSystem"]),
        "nvidia-smi": nvidia,
        "vulkaninfo": vulkaninfo,
        "video": json.dumps(video) if video is not None else "",
        "listeners": listeners,
        "binaries": binaries,
        "end": "",
    }
    return "\n".join(f"@@@ {name}\n{body}" for name, body in sections.items())


def test_a_windows_pc_without_nvidia_is_one_cpu_device_of_its_visible_memory():
    report = build_windows_report(_output(), rpc_port=50052)
    assert report.platform == "windows"
    assert (report.hostname, report.os_name, report.kernel, report.arch) == (
        "GAMING-PC",
        "Microsoft Windows 11 Pro",
        "10.0.22631",
        "x86_64",
    )
    assert report.cpu_model == "AMD Ryzen 7 5800X 8-Core Processor"  # the firmware's padding trimmed
    assert report.cpu_cores == 16 and report.cpu_threads_per_core == 2  # 8 cores with SMT: 8 server threads
    [cpu] = report.devices
    assert (cpu.name, cpu.kind) == ("CPU", "cpu")
    assert cpu.total_bytes == 33473476 * 1024 and cpu.free_bytes == 21036544 * 1024
    assert not report.rpc_port_in_use and report.binaries == {}


def test_nvidia_gpus_on_windows_are_cuda_devices():
    csv = (DATA / "probe" / "nvidia_smi_one_gpu.csv").read_text()
    report = build_windows_report(_output(nvidia=csv), rpc_port=50052)
    assert [d.name for d in report.devices] == ["CPU", "CUDA0"]
    gpu = report.devices[1]
    assert gpu.description == "NVIDIA GeForce RTX 3090" and gpu.total_bytes == 24576 * 1024**2


def test_two_processor_sockets_count_both():
    assert build_windows_report(_output(two_sockets=True), rpc_port=50052).cpu_cores == 32


def test_the_rpc_ports_holder_comes_from_get_nettcpconnection():
    listeners = '[{"LocalAddress":"0.0.0.0","LocalPort":50052,"OwningProcess":4242},' + (
        '{"LocalAddress":"::","LocalPort":50052,"OwningProcess":4242}]'
    )
    report = build_windows_report(_output(listeners=listeners), rpc_port=50052)
    assert report.rpc_port_pid == 4242 and report.rpc_port_in_use


def test_llama_cpp_programs_on_the_path_are_found_by_their_exe_names():
    text = "C:\\llama\\ggml-rpc-server.exe\nC:\\llama\\llama-server.exe\nnot a path\n"
    assert parse_windows_binaries(text) == {
        "ggml-rpc-server": "C:\\llama\\ggml-rpc-server.exe",
        "llama-server": "C:\\llama\\llama-server.exe",
    }


def test_output_that_is_not_json_is_a_warning_not_a_crash():
    report = build_windows_report("@@@ computer\nGet-CimInstance : Access denied\n@@@ end\n", rpc_port=1)
    assert any("not JSON" in w for w in report.warnings)


def test_the_probe_script_asks_for_the_port_it_was_given():
    assert "-LocalPort 50123 " in probe_script(50123)


VIDEO = json.loads((DATA / "probe" / "windows_video_controllers.json").read_text())


def _recorded(name: str) -> str:
    return (DATA / "probe" / name).read_text()


def test_an_intel_integrated_gpu_on_windows_is_vulkan0_sharing_the_systems_ram():
    """vulkaninfo --summary prints the same on Windows as on Linux (Intel's Windows driver here): the
    integrated GPU is Vulkan0, modelled as the system's RAM in place of the CPU, as on Linux."""
    report = build_windows_report(
        _output(
            vulkaninfo=_recorded("windows_vulkaninfo_summary_intel_iris_xe.txt"),
            video=VIDEO["intel_iris_xe_laptop"],
        ),
        rpc_port=50052,
    )
    [gpu] = report.devices
    assert (gpu.name, gpu.kind, gpu.description) == ("Vulkan0", "vulkan", "Intel(R) Iris(R) Xe Graphics")
    assert gpu.unified_memory and gpu.total_bytes == 33473476 * 1024
    assert any("integrated GPU that shares the system's RAM" in w for w in report.warnings)


def test_an_amd_gpu_on_windows_is_a_vulkan_device_whose_memory_the_banner_gives():
    """Win32_VideoController's AdapterRAM is 32 bits: a 24 GB card reads as 4 GiB, which is not taken."""
    report = build_windows_report(
        _output(
            vulkaninfo=_recorded("windows_vulkaninfo_summary_amd_rx7900xtx.txt"), video=VIDEO["amd_rx7900xtx"]
        ),
        rpc_port=50052,
    )
    assert [d.name for d in report.devices] == ["CPU", "Vulkan0"]
    gpu = report.devices[1]
    assert (gpu.kind, gpu.description, gpu.total_bytes, gpu.unified_memory) == (
        "vulkan",
        "AMD Radeon RX 7900 XTX",
        0,
        False,
    )
    assert gpu.bandwidth_gbs and gpu.bandwidth_gbs > 500  # the table's figure for the part
    assert any("Vulkan0 (AMD Radeon RX 7900 XTX): its memory is not known" in w for w in report.warnings)


def test_an_amd_or_intel_gpu_without_vulkaninfo_is_named_with_what_brings_it():
    report = build_windows_report(_output(video=VIDEO["intel_iris_xe_laptop"]), rpc_port=50052)
    assert [d.name for d in report.devices] == ["CPU"]
    [warning] = [w for w in report.warnings if "vulkaninfo is not installed" in w]
    assert warning.startswith("Intel GPU Intel(R) Iris(R) Xe Graphics found")
    assert "the GPU vendor's driver" in warning and "apt" not in warning and "mesa" not in warning


def test_vulkan_devices_are_not_listed_beside_nvidias_cuda_ones():
    csv = (DATA / "probe" / "nvidia_smi_one_gpu.csv").read_text()
    vulkan = _recorded("windows_vulkaninfo_summary_amd_rx7900xtx.txt")
    report = build_windows_report(_output(nvidia=csv, vulkaninfo=vulkan), rpc_port=50052)
    assert [d.name for d in report.devices] == ["CPU", "CUDA0"]


def test_the_probe_script_asks_for_vulkaninfo_and_the_video_controllers():
    script = probe_script(50052)
    assert "vulkaninfo --summary" in script and "Win32_VideoController" in script
