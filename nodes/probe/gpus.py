"""GPUs beyond nvidia-smi's: Vulkan devices, the GPUs on the PCI bus, and AMD GPUs' compile targets, from what
the probe script printed (pure, no Django).

`vulkaninfo --summary` lists every Vulkan physical device; llama.cpp's Vulkan backend does not use them
all. It takes the discrete and integrated GPUs in the order the loader lists them, one per GPU when two
drivers expose the same one (same deviceUUID), and only when there is none the first device that is not a
CPU; Mesa's llvmpipe (a CPU device) is never taken by default (ggml-vulkan.cpp, `ggml_vk_instance_init`).
Its devices are named Vulkan0, Vulkan1, … in that order, and so are ours. When the node's environment sets
GGML_VK_VISIBLE_DEVICES (indices into the loader's list, like CUDA_VISIBLE_DEVICES), llama.cpp takes exactly
those, in that order, CPU devices included: that is how llvmpipe becomes a Vulkan0, and it is the CPU's own
RAM, so it is modelled as sharing it like an integrated GPU.

The summary states no memory. A discrete AMD card's VRAM comes from the amdgpu driver's sysfs files (the
probe's `drm` section: "cardN vendor device vram_total vram_used"), matched by PCI vendor and device ID; an
integrated GPU draws on the system's RAM, so it is modelled as sharing it (`add_vulkan`). What stays unknown
is filled in by the build's own rpc-server banner (builds/).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nodes.probe.bandwidth import gpu_bandwidth, integrated_bandwidth
from nodes.probe.devices import DeviceInfo

GPU_TYPES = ("PHYSICAL_DEVICE_TYPE_DISCRETE_GPU", "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU")
CPU_TYPE = "PHYSICAL_DEVICE_TYPE_CPU"
INTEGRATED = "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU"
VENDORS = {"0x1002": "AMD", "0x8086": "Intel", "0x10de": "NVIDIA"}


@dataclass(frozen=True)
class VulkanDevice:
    index: int  # the loader's GPU<index> in vulkaninfo
    name: str
    device_type: str
    vendor_id: str  # "0x1002"
    device_id: str  # "0x744c"
    uuid: str
    driver: str

    @property
    def integrated(self) -> bool:
        return self.device_type == INTEGRATED

    @property
    def shares_system_memory(self) -> bool:
        """An integrated GPU, or a CPU device (Mesa's llvmpipe), whose "device memory" is the system's RAM."""
        return self.device_type in (INTEGRATED, CPU_TYPE)

    @property
    def vendor(self) -> str:
        return VENDORS.get(self.vendor_id, "")


def parse_vulkaninfo_summary(text: str) -> list[VulkanDevice]:
    """Every physical device of `vulkaninfo --summary`, in the loader's order."""
    devices: list[VulkanDevice] = []
    block: dict[str, str] | None = None
    blocks: list[tuple[int, dict[str, str]]] = []
    in_devices = False
    for line in text.splitlines():
        if line.strip() == "Devices:":
            in_devices = True
            continue
        if not in_devices:
            continue
        header = re.fullmatch(r"GPU(\d+):", line.strip())
        if header and not line.startswith(("\t", " ")):
            block = {}
            blocks.append((int(header.group(1)), block))
            continue
        key, sep, value = line.partition("=")
        if block is not None and sep and line.startswith(("\t", " ")):
            block[key.strip()] = value.strip()
    for index, values in blocks:
        devices.append(
            VulkanDevice(
                index=index,
                name=values.get("deviceName", ""),
                device_type=values.get("deviceType", ""),
                vendor_id=values.get("vendorID", "").lower(),
                device_id=values.get("deviceID", "").lower(),
                uuid=values.get("deviceUUID", ""),
                driver=values.get("driverName", ""),
            )
        )
    return devices


def parse_visible(text: str) -> list[int] | None:
    """The probe's `vk-visible` section: GGML_VK_VISIBLE_DEVICES's indices when the node sets it ("set=0,2"),
    None when it does not. llama.cpp reads it as numbers separated by commas or spaces and stops at the
    first that is not one."""
    for line in text.splitlines():
        if line.startswith("set="):
            indices = []
            for word in line[4:].replace(",", " ").split():
                if not word.isdigit():
                    break
                indices.append(int(word))
            return indices
    return None


def llama_vulkan_devices(devices: list[VulkanDevice], visible: list[int] | None = None) -> list[VulkanDevice]:
    """The devices llama.cpp's Vulkan backend uses, in its order: Vulkan0 is the first. `visible` is the
    node's GGML_VK_VISIBLE_DEVICES: exactly those of the loader's list (an index past its end makes llama.cpp
    fail, so it is not a device)."""
    if visible is not None:
        by_index = {d.index: d for d in devices}
        return [by_index[i] for i in visible if i in by_index]
    chosen: list[VulkanDevice] = []
    for device in devices:
        if device.device_type in GPU_TYPES and not any(c.uuid and c.uuid == device.uuid for c in chosen):
            chosen.append(device)
    if not chosen:
        chosen = [d for d in devices if d.device_type != CPU_TYPE][:1]
    return chosen


@dataclass(frozen=True)
class DrmCard:
    card: str
    vendor_id: str
    device_id: str
    vram_total: int
    vram_used: int


def parse_drm(text: str) -> list[DrmCard]:
    """The probe's `drm` section: "card1 0x1002 0x744c 25753026560 1116504064" per GPU."""
    cards = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[3].isdigit() and parts[4].isdigit():
            cards.append(DrmCard(parts[0], parts[1].lower(), parts[2].lower(), int(parts[3]), int(parts[4])))
    return cards


def vram_of(device: VulkanDevice, cards: list[DrmCard]) -> tuple[int, int] | None:
    """(total, free) VRAM of a discrete GPU from its driver's sysfs files, when the driver exports them."""
    for card in cards:
        if (card.vendor_id, card.device_id) == (device.vendor_id, device.device_id) and card.vram_total:
            return card.vram_total, max(0, card.vram_total - card.vram_used)
    return None


_LSPCI_GPU = re.compile(r"\[(0300|0302|0380)\]: (?P<name>.+?) \[(?P<vendor>[0-9a-f]{4}):[0-9a-f]{4}\]")


def pci_gpus(lspci: str, cards: list[DrmCard]) -> list[tuple[str, str]]:
    """(vendor, name) of each GPU on the PCI bus: lspci -nn's display controllers, or sysfs's vendor IDs
    when lspci is not installed."""
    found = []
    for line in lspci.splitlines():
        match = _LSPCI_GPU.search(line)
        if match:
            found.append((VENDORS.get("0x" + match["vendor"], match["vendor"]), match["name"]))
    if not found:
        found = [(VENDORS[c.vendor_id], f"PCI device {c.device_id}") for c in cards if c.vendor_id in VENDORS]
    return found


def parse_gfx_targets(rocm_smi: str, kfd: str = "") -> list[str]:
    """The GPUs' gfx targets: rocm-smi's "GFX Version" (JSON or text), else the KFD topology's
    `gfx_target_version` numbers (major*10000 + minor*100 + stepping: 110000 is gfx1100, 90010 gfx90a; the
    CPU's node says 0)."""
    targets = re.findall(r"GFX Version\"?\s*:\s*\"?\s*(gfx[0-9a-f]+)", rocm_smi, flags=re.I)
    if not targets:
        for value in kfd.split():
            if value.isdigit() and int(value):
                number = int(value)
                major, minor, stepping = number // 10000, number // 100 % 100, number % 100
                targets.append(f"gfx{major}{minor}{stepping:x}")
    return sorted({t.lower() for t in targets})


_VULKAN_PACKAGES = (
    "Debian/Ubuntu and Fedora: mesa-vulkan-drivers vulkan-tools; Arch: vulkan-intel or vulkan-radeon, "
    "vulkan-tools"
)


def add_vulkan(
    report: Any,
    sections: dict[str, str],
    *,
    cuda_or_rocm: bool,
    cards: list[DrmCard] | None = None,
    gpus: list[tuple[str, str]] | None = None,
    packages: str = "",
) -> None:
    """The GPUs llama.cpp's Vulkan backend would use, named as it names them (nodes/probe/vulkan.py).

    A node with NVIDIA or AMD GPUs under CUDA or ROCm is built for those, and such a build has no Vulkan
    devices: theirs are not listed twice. An integrated GPU reads the system's RAM: it is modelled as sharing
    it, like Apple's unified memory, so it replaces the CPU device (one memory, counted once; the planner
    gives a coordinator's CPU its share of that pool). `cards` (VRAM by PCI IDs), `gpus` (vendor, name) and
    `packages` (what brings vulkaninfo) come from the probe's `drm` and `lspci` sections and the Linux
    packages unless the caller has its own (Windows: Win32_VideoController, the GPU vendor's driver)."""
    if cards is None:
        cards = parse_drm(sections.get("drm", ""))
    listed = parse_vulkaninfo_summary(sections.get("vulkaninfo", ""))
    visible = parse_visible(sections.get("vk-visible", ""))
    chosen = llama_vulkan_devices(listed, visible)
    if visible is not None:
        unknown = [i for i in visible if i not in {d.index for d in listed}]
        if unknown and listed:
            report.warnings.append(
                f"GGML_VK_VISIBLE_DEVICES names Vulkan device {', '.join(map(str, unknown))}, which "
                "vulkaninfo does not list: llama.cpp's Vulkan backend fails to start with it. Correct it on "
                "the node."
            )
    if cuda_or_rocm:
        if chosen:
            names = ", ".join(d.name for d in chosen)
            report.warnings.append(f"Vulkan devices ({names}) are not listed: this node builds CUDA or ROCm.")
        return
    if not sections.get("vulkaninfo", "").strip():
        for vendor, name in pci_gpus(sections.get("lspci", ""), cards) if gpus is None else gpus:
            if vendor in ("Intel", "AMD"):
                report.warnings.append(
                    f"{vendor} GPU {name} found, but vulkaninfo is not installed, so llama.cpp's Vulkan "
                    f"backend cannot be checked: install the Vulkan driver and tools "
                    f"({packages or _VULKAN_PACKAGES}), then probe again."
                )
        return
    if listed and not chosen and visible is None:
        report.warnings.append(
            "Vulkan lists only a CPU device (such as Mesa's llvmpipe): that is the CPU itself, counted once."
        )
    cpu = next((d for d in report.devices if d.name == "CPU"), None)
    for number, device in enumerate(chosen):
        name = f"Vulkan{number}"
        if device.shares_system_memory:
            gbs, why = integrated_bandwidth(device.name, report.cpu_model)
            report.devices.append(
                DeviceInfo(
                    name,
                    "vulkan",
                    device.name,
                    report.ram_total_bytes,
                    report.ram_available_bytes,
                    unified_memory=True,
                    bandwidth_gbs=gbs,
                )
            )
            report.warnings.append(f"{name} bandwidth {gbs:g} GB/s is an estimate ({why}).")
            if cpu in report.devices:
                # The CPU's own estimate was about this same memory: the integrated GPU stands for it now.
                report.devices.remove(cpu)
                report.warnings[:] = [w for w in report.warnings if not w.startswith("CPU bandwidth")]
                what = "an integrated GPU" if device.integrated else "a CPU device (Mesa's llvmpipe)"
                report.warnings.append(
                    f"{name} is {what} that shares the system's RAM: it is planned as that one "
                    "memory, in place of the CPU."
                )
            continue
        vram = vram_of(device, cards)
        if vram is None:
            report.warnings.append(
                f"{name} ({device.name}): its memory is not known until a Vulkan build's rpc-server "
                "reports it."
            )
        total, free = vram or (0, 0)
        gbs = gpu_bandwidth(device.name)
        report.devices.append(DeviceInfo(name, "vulkan", device.name, total, free, False, gbs))
