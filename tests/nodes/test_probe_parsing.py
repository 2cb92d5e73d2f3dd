"""Hardware probe parsers on recorded outputs of real tools (tests/data/probe/)."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from nodes.probe import bandwidth, gpus
from nodes.probe import parse as probe
from remote.listeners import parse_ss
from tests.paths import DATA as TEST_DATA
from tests.probe_reports import recorded, report_of

DATA = TEST_DATA / "probe"
GIB = 1024**3
MIB = 1024**2


# -- whole reports ------------------------------------------------------------------------------------


def test_a_debian_vm_recorded_here_has_one_cpu_device_with_its_ram():
    report = report_of("linux_debian12_x86_64.txt")
    assert report.platform == "linux"
    assert report.os_name == "Debian GNU/Linux 12 (bookworm)"
    assert (report.kernel, report.arch, report.hostname) == ("6.18.44-fc-v857", "x86_64", "vm")
    assert (report.cpu_model, report.cpu_cores) == ("AMD EPYC", 2)
    assert report.ram_total_bytes == 24683652 * 1024
    assert report.ram_available_bytes == 23826052 * 1024
    assert report.memory_limit_bytes is None  # v1 "unlimited" is a huge number, not a limit.
    [cpu] = report.devices
    assert (cpu.name, cpu.kind, cpu.unified_memory) == ("CPU", "cpu", False)
    assert cpu.total_bytes == report.ram_total_bytes and cpu.free_bytes == report.ram_available_bytes
    assert cpu.bandwidth_gbs and cpu.bandwidth_gbs > 0
    assert report.rpc_server_binary.endswith("/ggml-rpc-server")
    assert report.binaries["llama-server"].endswith("/llama-server")
    assert (report.llama_version, report.llama_commit) == ("0.6.0-dev", "")
    assert not report.rpc_port_in_use  # Nobody listens on 50052 in that recording...
    other_port = report_of("linux_debian12_x86_64.txt", rpc_port=50161)
    assert (other_port.rpc_port_pid, other_port.rpc_port_process) == (24346, "ggml-rpc-server")


def test_an_ubuntu_desktop_with_an_rtx_3090_has_cpu_and_cuda0_and_a_legacy_rpc_server():
    report = report_of("linux_ubuntu_rtx3090.txt")
    assert [d.name for d in report.devices] == ["CPU", "CUDA0"]
    cpu, gpu = report.devices
    assert cpu.description == "AMD Ryzen 9 5950X 16-Core Processor"
    assert report.cpu_cores == 32
    assert gpu.kind == "cuda" and gpu.description == "NVIDIA GeForce RTX 3090"
    assert (gpu.total_bytes, gpu.free_bytes) == (24576 * MIB, 23871 * MIB)
    assert gpu.bandwidth_gbs == 936.0
    assert report.rpc_server_binary == "/usr/local/bin/rpc-server"
    assert (report.llama_version, report.llama_commit) == ("4567", "a1b2c3d4")
    assert report.rpc_port_in_use and (report.rpc_port_pid, report.rpc_port_process) == (48211, "rpc-server")
    assert report.memory_limit_bytes is None  # cgroup v2 "max".


def test_a_container_with_a_cgroup_v2_limit_offers_only_its_limit():
    report = report_of("linux_container_cgroup_v2_arm64.txt")
    assert report.arch == "aarch64"
    assert report.cpu_model == "Raspberry Pi 5 Model B Rev 1.0"
    assert report.cpu_cores == 2  # nproc (affinity), not the 4 cores cpuinfo lists.
    assert report.memory_limit_bytes == 4 * GIB
    [cpu] = report.devices
    assert cpu.total_bytes == 4 * GIB
    assert cpu.free_bytes == 4 * GIB - 512 * MIB


def test_a_docker_container_on_cgroup_v1_without_memavailable_uses_limit_minus_usage():
    report = report_of("linux_docker_cgroup_v1_no_memavailable.txt")
    assert report.memory_limit_bytes == 8 * GIB
    assert report.ram_total_bytes == 8 * GIB
    assert report.ram_available_bytes == 8 * GIB - 7516192768
    assert any("nvidia-smi is installed but reported no GPU" in w for w in report.warnings)
    assert [d.name for d in report.devices] == ["CPU"]
    assert report.binaries == {} and report.rpc_server_binary == ""


def test_an_apple_m2_pro_is_one_unified_metal_device_with_its_raw_memory():
    report = report_of("macos_m2_pro.txt")
    assert report.platform == "macos"
    assert report.os_name == "macOS 14.4.1"
    assert (report.cpu_model, report.cpu_cores, report.ram_total_bytes) == ("Apple M2 Pro", 12, 32 * GIB)
    assert report.ram_available_bytes == (73829 + 801234 + 12010) * 16384
    [metal] = report.devices
    assert (metal.name, metal.kind, metal.unified_memory) == ("MTL0", "metal", True)
    # Raw memory: the planner, not the probe, takes the usable share (it used to be clamped in both).
    assert metal.total_bytes == metal.free_bytes == 32 * GIB
    assert metal.wired_limit_bytes is None  # iogpu.wired_limit_mb: 0 is macOS's default
    assert metal.description == "Apple M2 Pro (19-core GPU)"
    assert metal.bandwidth_gbs == 200.0
    assert (report.rpc_port_pid, report.llama_version, report.llama_commit) == (71337, "6800", "6de8ed75")


def test_a_raised_iogpu_wired_limit_is_reported_beside_the_raw_memory():
    [metal] = report_of("macos_m2_pro_wired_limit.txt").devices
    assert metal.total_bytes == 32 * GIB
    assert metal.wired_limit_bytes == 28672 * MIB


def test_an_intel_mac_is_planned_as_a_cpu_machine():
    report = report_of("macos_intel_radeon.txt")
    assert [d.name for d in report.devices] == ["CPU"]
    assert report.devices[0].total_bytes == 16 * GIB
    assert report.ram_available_bytes == (412331 + 1300112 + 40123) * 4096


def test_output_that_ends_early_is_reported_with_a_warning():
    text = recorded("linux_debian12_x86_64.txt").split("@@@ nvidia-smi")[0]
    report = probe.build_report(text, rpc_port=50052)
    assert report.devices[0].name == "CPU"
    assert any("ended early" in w for w in report.warnings)


def test_an_unknown_system_is_a_warning_not_a_crash():
    report = probe.build_report("@@@ uname\nFreeBSD 14.0-RELEASE amd64\n@@@ end\n", rpc_port=50052)
    assert report.devices == []
    assert "Unsupported system 'FreeBSD'" in report.warnings[0]


def test_facts_are_json_and_carry_no_devices():
    facts = report_of("linux_ubuntu_rtx3090.txt").facts()
    assert "devices" not in facts
    assert facts["rpc_port_in_use"] is True and facts["rpc_server_binary"] == "/usr/local/bin/rpc-server"
    assert json.loads(json.dumps(facts)) == facts


# -- single tools ------------------------------------------------------------------------------------------


def test_nvidia_smi_with_several_gpus_keeps_their_indexes():
    gpus = probe.parse_nvidia_smi(recorded("nvidia_smi_several_gpus.csv"))
    assert [(i, name) for i, name, _, _ in gpus] == [
        (0, "NVIDIA GeForce RTX 4090"),
        (1, "NVIDIA GeForce RTX 3090"),
        (2, "Tesla P40"),
    ]
    assert gpus[1][2:] == (24576 * MIB, 1012 * MIB)


def test_nvidia_smi_without_driver_or_with_na_memory_yields_no_gpu():
    assert probe.parse_nvidia_smi(recorded("nvidia_smi_no_driver.txt")) == []
    assert probe.parse_nvidia_smi(recorded("nvidia_smi_unified_na.csv")) == []


def test_several_nvidia_gpus_become_cuda0_cuda1_cuda2_after_the_cpu():
    text = recorded("linux_ubuntu_rtx3090.txt").replace(
        "0, NVIDIA GeForce RTX 3090, 24576, 23871", recorded("nvidia_smi_several_gpus.csv").strip()
    )
    devices = probe.build_report(text, rpc_port=50052).devices
    assert [d.name for d in devices] == ["CPU", "CUDA0", "CUDA1", "CUDA2"]
    assert [d.bandwidth_gbs for d in devices[1:]] == [1008.0, 936.0, 346.0]


def test_rocm_smi_json_gives_vram_total_and_free():
    gpus = probe.parse_rocm_smi(recorded("rocm_smi.json"))
    assert [(i, name) for i, name, _, _ in gpus] == [
        (0, "Navi 31 [Radeon RX 7900 XTX]"),
        (1, "Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]"),
    ]
    assert gpus[0][2:] == (25753026560, 25753026560 - 1116504064)


def test_rocm_smi_classic_text_is_understood_too():
    [(index, name, total, free)] = probe.parse_rocm_smi(recorded("rocm_smi_classic.txt"))
    assert (index, name, total, free) == (0, "Instinct MI210", 68702699520, 68702699520 - 11866112)
    assert bandwidth.gpu_bandwidth(name) == 1638.0


def test_amd_gpus_become_rocm_devices():
    text = recorded("linux_debian12_x86_64.txt").replace(
        "@@@ rocm-smi\n", "@@@ rocm-smi\n" + recorded("rocm_smi.json")
    )
    devices = probe.build_report(text, rpc_port=50052).devices
    assert [(d.name, d.kind, d.bandwidth_gbs) for d in devices[1:]] == [
        ("ROCm0", "rocm", 960.0),
        ("ROCm1", "rocm", 512.0),
    ]


def test_amd_gpus_carry_their_compile_targets_from_rocm_smi_or_the_kfd_topology():
    text = recorded("linux_debian12_x86_64.txt").replace(
        "@@@ rocm-smi\n", "@@@ rocm-smi\n" + recorded("rocm_smi.json")
    )
    report = probe.build_report(text, rpc_port=50052)
    assert report.amdgpu_targets == ["gfx1030", "gfx1100"]
    assert report.facts()["amdgpu_targets"] == ["gfx1030", "gfx1100"]
    # The classic text of an older rocm-smi has no GFX Version: the kernel's numbers stand in (the CPU's
    # node says 0; 90010 is the MI210's gfx90a).
    classic = recorded("rocm_smi_classic.txt")
    assert probe.parse_gfx_targets(classic, "0\n90010\n") == ["gfx90a"]
    assert probe.parse_gfx_targets("GPU[0]\t\t: GFX Version: \t\tgfx1101\n") == ["gfx1101"]
    assert probe.build_report(recorded("linux_debian12_x86_64.txt"), rpc_port=50052).amdgpu_targets == []


def test_meminfo_and_cgroup_values():
    assert probe.parse_meminfo("MemTotal: 100 kB\nMemAvailable: 40 kB\n") == (102400, 40960)
    assert probe.parse_cgroup_bytes("max") is None
    assert probe.parse_cgroup_bytes("9223372036854771712") is None
    assert probe.parse_cgroup_bytes("4294967296\n") == 4 * GIB


def test_the_probe_script_is_valid_posix_shell():
    result = subprocess.run(["sh", "-n", "-c", probe.PROBE_SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- bandwidth table ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chip", "gbs"),
    [("Apple M1", 68.25), ("Apple M1 Max", 400.0), ("Apple M3 Pro", 150.0), ("Apple M4 Pro", 273.0)],
)
def test_apple_chips_have_their_published_bandwidth(chip, gbs):
    assert bandwidth.apple_bandwidth(chip) == gbs


def test_gpu_names_match_the_most_specific_entry():
    assert bandwidth.gpu_bandwidth("NVIDIA GeForce RTX 4070 Ti SUPER") == 672.0
    assert bandwidth.gpu_bandwidth("NVIDIA GeForce RTX 4070") == 504.0
    assert bandwidth.gpu_bandwidth("NVIDIA A10") == 600.0  # Not the A100.
    assert bandwidth.gpu_bandwidth("Some Unknown Accelerator") is None


def test_cpu_bandwidth_is_a_labelled_estimate():
    assert bandwidth.cpu_bandwidth("AMD Ryzen 9 7950X 16-Core Processor")[0] == 65.0
    gbs, why = bandwidth.cpu_bandwidth("Mystery CPU")
    assert gbs == bandwidth.DEFAULT_CPU_GBS and "unknown" in why


def test_the_current_script_format_reads_files_from_one_head_block():
    # Recorded here with the current PROBE_SCRIPT: `head -v` blocks, cgroup v1 paths of this process.
    report = report_of("linux_debian12_x86_64_headv.txt")
    assert (report.cpu_model, report.cpu_cores, report.os_name) == (
        "AMD EPYC",
        2,
        "Debian GNU/Linux 12 (bookworm)",
    )
    assert report.ram_total_bytes == 24683652 * 1024
    assert 0 < report.ram_available_bytes <= report.ram_total_bytes
    assert report.memory_limit_bytes is None
    assert report.binaries["llama-server"].endswith("/build-cpu/bin/llama-server")
    assert report.rpc_server_binary.endswith("/build-cpu/bin/ggml-rpc-server")
    assert report.llama_version == "0.6.0-dev"


def test_a_cgroup_limit_inside_a_head_block_is_found():
    text = (
        "@@@ uname\nLinux 6.1.0 x86_64\n@@@ files\n"
        "==> /proc/meminfo <==\nMemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n\n"
        "==> /proc/self/status <==\nName:\thead\nCpus_allowed_list:\t0-3,8,10-11\n\n"
        "==> /sys/fs/cgroup/system.slice/docker-1.scope/memory.max <==\n2147483648\n\n"
        "==> /sys/fs/cgroup/system.slice/docker-1.scope/memory.current <==\n1073741824\n"
        "@@@ end\n"
    )
    report = probe.build_report(text, rpc_port=50052)
    assert report.cpu_cores == 7
    assert report.memory_limit_bytes == 2 * GIB
    assert (report.ram_total_bytes, report.ram_available_bytes) == (2 * GIB, 1 * GIB)


@pytest.mark.parametrize(("cpus", "count"), [("0", 1), ("0-1", 2), ("0-3,8,10-11", 7), ("", 0)])
def test_cpu_lists(cpus, count):
    assert probe.count_cpu_list(cpus) == count


def test_the_rpc_port_holder_of_another_user_is_reported_without_pid():
    report = probe.ProbeReport(rpc_port=50052)
    probe._set_port_holder(report, parse_ss("LISTEN 0 1 [::]:50052 [::]:*\n"))
    assert report.rpc_port_in_use and report.rpc_port_pid is None
    assert report.rpc_port_process == "unknown (not visible to this user)"


def test_a_cgroup_v1_limit_counts_the_working_set_and_the_cpu_quota_is_reported():
    # What the probe prints on a lab host held to 512 MiB and a quarter of a core (cgroup v1): the group's
    # usage includes 300 MiB of file cache the kernel gives up when a process needs it: not counted as used.
    text = (
        "@@@ uname\nLinux 6.1.0 x86_64\n@@@ files\n"
        "==> /proc/meminfo <==\nMemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n\n"
        "==> /sys/fs/cgroup/memory/rdlab-1-0/memory.limit_in_bytes <==\n536870912\n\n"
        "==> /sys/fs/cgroup/memory/rdlab-1-0/memory.usage_in_bytes <==\n419430400\n\n"
        "==> /sys/fs/cgroup/memory/rdlab-1-0/memory.stat <==\ncache 314572800\n"
        "inactive_file 1\ntotal_active_file 209715200\ntotal_inactive_file 104857600\n\n"
        "==> /sys/fs/cgroup/cpu/rdlab-1-0/cpu.cfs_quota_us <==\n25000\n\n"
        "==> /sys/fs/cgroup/cpu/rdlab-1-0/cpu.cfs_period_us <==\n100000\n"
        "@@@ end\n"
    )
    report = probe.build_report(text, rpc_port=50052)
    assert report.memory_limit_bytes == 512 * MIB
    assert (report.ram_total_bytes, report.ram_available_bytes) == (512 * MIB, 412 * MIB)
    assert report.cpu_quota_cores == 0.25 and report.cpu_quota_period_ms == 100.0
    assert any("CPU quota" in warning for warning in report.warnings)


@pytest.mark.parametrize(
    ("sections", "cores", "period_ms"),
    [
        ({"cgroup-v2-cpu-max": "max 100000"}, None, None),
        ({"cgroup-v2-cpu-max": "150000 100000"}, 1.5, 100.0),
        ({"cgroup-v1-cpu-quota": "-1", "cgroup-v1-cpu-period": "100000"}, None, None),
        ({"cgroup-v1-cpu-quota": "10000", "cgroup-v1-cpu-period": "100000"}, 0.1, 100.0),
        ({"cgroup-v1-cpu-quota": "1000", "cgroup-v1-cpu-period": "10000"}, 0.1, 10.0),
        ({}, None, None),
    ],
)
def test_cpu_quotas_and_the_period_they_are_granted_per(sections, cores, period_ms):
    assert probe.cgroup_cpu_quota(sections) == cores
    assert probe.cgroup_cpu_period_ms(sections) == period_ms


# -- Vulkan and integrated GPUs ------------------------------------------------------------------------------


def linux_with(**sections: str) -> probe.ProbeReport:
    """The recorded Debian probe with the named sections (vulkaninfo, drm, lspci, rocm-smi) filled in."""
    extra = "".join(f"@@@ {name.replace('_', '-')}\n{recorded(file)}\n" for name, file in sections.items())
    text = recorded("linux_debian12_x86_64.txt").replace("@@@ rocm-smi\n", "@@@ rocm-smi\n\n" + extra, 1)
    if "rocm_smi" in sections:
        text = text.replace("@@@ rocm-smi\n\n@@@ rocm-smi", "@@@ rocm-smi", 1)
    return probe.build_report(text, rpc_port=50052)


def test_vulkaninfo_summary_lists_every_physical_device_in_the_loaders_order():
    amd = gpus.parse_vulkaninfo_summary(recorded("vulkaninfo_summary_amd_rx7900xtx.txt"))
    assert [(d.index, d.name, d.device_type, d.vendor) for d in amd] == [
        (0, "AMD Radeon RX 7900 XTX (RADV NAVI31)", "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU", "AMD"),
        (1, "llvmpipe (LLVM 17.0.6, 256 bits)", "PHYSICAL_DEVICE_TYPE_CPU", ""),
    ]
    assert (amd[0].vendor_id, amd[0].device_id, amd[0].driver) == ("0x1002", "0x744c", "radv")
    # llama.cpp takes the GPUs only: Mesa's CPU driver is the CPU itself.
    assert [d.name for d in gpus.llama_vulkan_devices(amd)] == ["AMD Radeon RX 7900 XTX (RADV NAVI31)"]
    assert (
        gpus.llama_vulkan_devices(gpus.parse_vulkaninfo_summary(recorded("vulkaninfo_summary_llvmpipe.txt")))
        == []
    )
    # One GPU under two drivers (RADV and AMDVLK share the deviceUUID) is one device, as llama.cpp keeps one.
    twice = amd[:1] + [dataclasses.replace(amd[0], index=2, driver="AMD open-source driver")]
    assert len(gpus.llama_vulkan_devices(twice)) == 1


def test_an_amd_card_without_rocm_is_vulkan0_with_its_vram_from_sysfs():
    report = linux_with(vulkaninfo="vulkaninfo_summary_amd_rx7900xtx.txt", drm="drm_amd_rx7900xtx.txt")
    assert [d.name for d in report.devices] == ["CPU", "Vulkan0"]
    vulkan = report.devices[1]
    assert (vulkan.kind, vulkan.description) == ("vulkan", "AMD Radeon RX 7900 XTX (RADV NAVI31)")
    assert (vulkan.total_bytes, vulkan.free_bytes) == (25753026560, 25753026560 - 1116504064)
    assert vulkan.bandwidth_gbs == 960.0 and not vulkan.unified_memory
    # Without the amdgpu files its memory waits for the build's banner, and the page says so.
    bare = linux_with(vulkaninfo="vulkaninfo_summary_amd_rx7900xtx.txt")
    assert (bare.devices[1].total_bytes, bare.devices[1].free_bytes) == (0, 0)
    assert any("not known until a Vulkan build's rpc-server reports it" in w for w in bare.warnings)


def test_an_intel_integrated_gpu_shares_the_systems_ram_and_is_counted_once():
    report = linux_with(vulkaninfo="vulkaninfo_summary_intel_iris_xe.txt", drm="drm_intel_iris_xe.txt")
    [igpu] = report.devices  # no CPU beside it: one memory, like a Mac's MTL0
    assert (igpu.name, igpu.kind, igpu.unified_memory) == ("Vulkan0", "vulkan", True)
    assert igpu.description == "Intel(R) Iris(R) Xe Graphics (ADL GT2)"
    assert (igpu.total_bytes, igpu.free_bytes) == (report.ram_total_bytes, report.ram_available_bytes)
    assert igpu.bandwidth_gbs == 68.0
    assert any("integrated GPU that shares the system's RAM" in w for w in report.warnings)
    assert not any(w.startswith("CPU bandwidth") for w in report.warnings)


def test_mesa_llvmpipe_alone_adds_no_device():
    report = linux_with(vulkaninfo="vulkaninfo_summary_llvmpipe.txt")
    assert [d.name for d in report.devices] == ["CPU"]
    assert any("that is the CPU itself, counted once" in w for w in report.warnings)


def test_a_rocm_node_does_not_list_its_gpu_again_under_vulkan():
    report = linux_with(rocm_smi="rocm_smi.json", vulkaninfo="vulkaninfo_summary_amd_rx7900xtx.txt")
    assert [d.name for d in report.devices] == ["CPU", "ROCm0", "ROCm1"]
    assert any("this node builds CUDA or ROCm" in w for w in report.warnings)


def test_an_intel_gpu_without_vulkaninfo_is_named_with_the_packages_to_install():
    report = linux_with(lspci="lspci_nn_intel_iris_xe.txt", drm="drm_intel_iris_xe.txt")
    assert [d.name for d in report.devices] == ["CPU"]
    [warning] = [w for w in report.warnings if "vulkaninfo is not installed" in w]
    assert warning.startswith("Intel GPU Intel Corporation Alder Lake-P GT2 [Iris Xe Graphics] found")
    assert "mesa-vulkan-drivers vulkan-tools" in warning
    # Without lspci, sysfs's vendor ID still tells an Intel GPU is there.
    assert gpus.pci_gpus("", gpus.parse_drm(recorded("drm_intel_iris_xe.txt"))) == [
        ("Intel", "PCI device 0x46a6")
    ]


@pytest.mark.parametrize(
    ("name", "gbs"),
    [
        ("AMD Radeon RX 7900 XTX (RADV NAVI31)", 960.0),
        ("AMD Radeon RX 7600 XT (RADV NAVI33)", 288.0),
        ("AMD Radeon RX 6600 (RADV NAVI23)", 224.0),
        ("AMD Radeon RX 9070 XT (RADV GFX1201)", 644.6),
        ("Intel(R) Arc(tm) A770 Graphics (DG2)", 560.0),
        ("Intel(R) Arc(tm) B580 Graphics (BMG G21)", 456.0),
        ("Intel(R) Arc(tm) A380 Graphics (DG2)", 186.0),
    ],
)
def test_common_amd_and_intel_cards_have_their_published_bandwidth(name, gbs):
    assert bandwidth.gpu_bandwidth(name) == gbs


def test_integrated_gpus_take_their_memorys_figure_or_the_cpus():
    assert bandwidth.integrated_bandwidth("AMD Radeon 8060S Graphics (RADV GFX1151)", "")[0] == 256.0
    assert bandwidth.integrated_bandwidth("Intel(R) Arc(tm) Graphics (MTL)", "")[0] == 90.0
    gbs, why = bandwidth.integrated_bandwidth("AMD Radeon Graphics (RADV GFX1103_R1)", "AMD Ryzen 7 7840U")
    assert (gbs, why) == (65.0, "shares the system memory: Ryzen 7000/8000/9000, dual-channel DDR5")


def test_the_probe_reads_each_cards_ids_and_vram_from_sysfs_and_skips_connectors(tmp_path):
    """The script's drm loop, run by the real shell over a copy of sysfs's layout."""
    files = {
        "card0/device/vendor": "0x8086",
        "card0/device/device": "0x46a6",
        "card1/device/vendor": "0x1002",
        "card1/device/device": "0x744c",
        "card1/device/mem_info_vram_total": "25753026560",
        "card1/device/mem_info_vram_used": "1116504064",
        "card1-DP-1/status": "connected",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    script = probe.PROBE_SCRIPT
    loop = script[script.index("  sec drm") : script.index("  sec lspci")].replace(
        "/sys/class/drm/", f"{tmp_path}/"
    )
    result = subprocess.run(["sh", "-c", "sec() { :; }\n" + loop], capture_output=True, text=True, check=True)
    assert result.stdout == "card0 0x8086 0x46a6 0 0\ncard1 0x1002 0x744c 25753026560 1116504064\n"
    assert recorded("drm_amd_rx7900xtx.txt") in result.stdout


def linux_with_text(**sections: str) -> probe.ProbeReport:
    """The recorded Debian probe with the named sections' text (not files) filled in."""
    extra = "".join(f"@@@ {name.replace('_', '-')}\n{text}\n" for name, text in sections.items())
    text = recorded("linux_debian12_x86_64.txt").replace("@@@ rocm-smi\n", "@@@ rocm-smi\n\n" + extra, 1)
    return probe.build_report(text, rpc_port=50052)


@pytest.mark.parametrize(
    ("section", "indices"),
    [("", None), ("set=0\n", [0]), ("set=1,0\n", [1, 0]), ("set=2 3\n", [2, 3]), ("set=\n", []),
     ("set=0,x,1\n", [0])],
)  # fmt: skip
def test_ggml_vk_visible_devices_is_read_as_llamacpp_reads_it(section, indices):
    assert gpus.parse_visible(section) == indices


def test_llvmpipe_named_by_ggml_vk_visible_devices_is_vulkan0_sharing_the_systems_ram():
    """With GGML_VK_VISIBLE_DEVICES=0 llama.cpp's Vulkan backend takes Mesa's CPU driver as Vulkan0 (its
    rpc-server then serves Vulkan0 and not the CPU): that device's memory is the system's RAM, so it is
    planned as that one memory in place of the CPU, like an integrated GPU."""
    report = linux_with_text(vulkaninfo=recorded("vulkaninfo_summary_llvmpipe.txt"), vk_visible="set=0")
    [device] = report.devices
    assert (device.name, device.kind, device.unified_memory) == ("Vulkan0", "vulkan", True)
    assert device.description.startswith("llvmpipe (LLVM 15.0.6")
    assert (device.total_bytes, device.free_bytes) == (report.ram_total_bytes, report.ram_available_bytes)
    assert any("a CPU device (Mesa's llvmpipe) that shares the system's RAM" in w for w in report.warnings)
    assert not any("that is the CPU itself" in w for w in report.warnings)
    # llama.cpp's own choice without it (the GPUs, never llvmpipe) is unchanged, and so is an empty list.
    amd = gpus.parse_vulkaninfo_summary(recorded("vulkaninfo_summary_amd_rx7900xtx.txt"))
    assert [d.index for d in gpus.llama_vulkan_devices(amd, [1, 0])] == [1, 0]
    assert gpus.llama_vulkan_devices(amd, []) == []


def test_ggml_vk_visible_devices_naming_a_device_vulkan_lacks_is_said():
    report = linux_with_text(vulkaninfo=recorded("vulkaninfo_summary_llvmpipe.txt"), vk_visible="set=3")
    assert [d.name for d in report.devices] == ["CPU"]
    assert any("GGML_VK_VISIBLE_DEVICES names Vulkan device 3" in w for w in report.warnings)
