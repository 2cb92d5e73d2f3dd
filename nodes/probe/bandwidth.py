"""Memory bandwidth of known chips, in GB/s, for the planner's speed model (no Django here).

Single-stream decode reads every weight once per token, so a device's memory bandwidth bounds its speed.
Figures are the vendors' published peak numbers; CPU figures are typical *achievable* numbers for a
memory configuration, because a CPU rarely gets near its theoretical peak. An operator can override any
device's figure, and a measurement wins over this table.
"""

from __future__ import annotations

import re

# Matched against the normalised device name, longest key first, so "m2 pro" wins over "m2".
APPLE_GBS: dict[str, float] = {
    "apple m1": 68.25,
    "apple m1 pro": 200.0,
    "apple m1 max": 400.0,
    "apple m1 ultra": 800.0,
    "apple m2": 100.0,
    "apple m2 pro": 200.0,
    "apple m2 max": 400.0,
    "apple m2 ultra": 800.0,
    "apple m3": 100.0,
    "apple m3 pro": 150.0,
    "apple m3 max": 400.0,
    "apple m3 ultra": 819.0,
    "apple m4": 120.0,
    "apple m4 pro": 273.0,
    "apple m4 max": 546.0,
}

NVIDIA_GBS: dict[str, float] = {
    "rtx 5090": 1792.0,
    "rtx 5080": 960.0,
    "rtx 5070 ti": 896.0,
    "rtx 5070": 672.0,
    "rtx 5060 ti": 448.0,
    "rtx 4090": 1008.0,
    "rtx 4080 super": 736.0,
    "rtx 4080": 716.8,
    "rtx 4070 ti super": 672.0,
    "rtx 4070 ti": 504.0,
    "rtx 4070 super": 504.0,
    "rtx 4070": 504.0,
    "rtx 4060 ti": 288.0,
    "rtx 4060": 272.0,
    "rtx 3090 ti": 1008.0,
    "rtx 3090": 936.0,
    "rtx 3080 ti": 912.0,
    "rtx 3080": 760.0,
    "rtx 3070 ti": 608.0,
    "rtx 3070": 448.0,
    "rtx 3060 ti": 448.0,
    "rtx 3060": 360.0,
    "rtx 2080 ti": 616.0,
    "rtx 2080": 448.0,
    "rtx 2070": 448.0,
    "rtx 2060": 336.0,
    "gtx 1080 ti": 484.0,
    "gtx 1080": 320.0,
    "gtx 1070": 256.0,
    "gtx 1660": 192.0,
    "titan rtx": 672.0,
    "rtx a6000": 768.0,
    "rtx a5000": 768.0,
    "rtx a4000": 448.0,
    "rtx 6000 ada": 960.0,
    "rtx 4000 ada": 360.0,
    "a100-sxm4-80gb": 2039.0,
    "a100 80gb": 1935.0,
    "a100": 1555.0,
    "h100 pcie": 2039.0,
    "h100 80gb hbm3": 3350.0,
    "h100": 3350.0,
    "h200": 4800.0,
    "l40s": 864.0,
    "l40": 864.0,
    "l4": 300.0,
    "a10": 600.0,
    "t4": 320.0,
    "v100": 900.0,
    "p100": 732.0,
    "p40": 346.0,
}

AMD_GBS: dict[str, float] = {
    "rx 7900 xtx": 960.0,
    "rx 7900 xt": 800.0,
    "rx 7800 xt": 624.0,
    "rx 7600": 288.0,
    "rx 6950 xt": 576.0,
    "rx 6900 xt": 512.0,
    "rx 6800 xt": 512.0,
    "rx 6800": 512.0,
    "rx 6700 xt": 384.0,
    "radeon vii": 1024.0,  # Normalised to "vii" like the names it is matched against.
    "mi300x": 5300.0,
    "mi250x": 3277.0,
    "mi250": 3277.0,
    "mi210": 1638.0,
    "mi100": 1229.0,
    "mi50": 1024.0,
    "rx 9070 xt": 644.6,
    "rx 9070": 644.6,
    "rx 9060 xt": 322.3,
    "rx 7900 gre": 576.0,
    "rx 7700 xt": 432.0,
    "rx 7600 xt": 288.0,
    "rx 6750 xt": 432.0,
    "rx 6700": 320.0,
    "rx 6650 xt": 280.0,
    "rx 6600 xt": 256.0,
    "rx 6600": 224.0,
    "rx 5700 xt": 448.0,
    "rx 5700": 448.0,
    "rx 5600 xt": 288.0,
    "rx 590": 256.0,
    "rx 580": 256.0,
    "rx 570": 224.0,
    "vega 64": 484.0,
    "vega 56": 410.0,
    "pro w7900": 864.0,
    "pro w7800": 576.0,
    "pro w6800": 512.0,
}

# Intel's discrete cards (Arc), by the name Vulkan drivers give them ("Intel(R) Arc(tm) A770 Graphics").
INTEL_GBS: dict[str, float] = {
    "arc a770": 560.0,
    "arc a750": 512.0,
    "arc a580": 512.0,
    "arc a380": 186.0,
    "arc a310": 124.0,
    "arc b580": 456.0,
    "arc b570": 380.0,
    "arc pro a60": 384.0,
    "arc pro b60": 456.0,
}

# Integrated GPUs read the system's RAM, so their figure is that memory's: the typical configuration each
# chip ships with (Strix Halo's 256-bit LPDDR5X, a laptop's dual-channel LPDDR5). Unknown ones take the CPU
# table's figure for the same machine.
INTEGRATED_GBS: dict[str, float] = {
    "radeon 8060s": 256.0,
    "radeon 8050s": 256.0,
    "radeon 890m": 120.0,
    "radeon 880m": 120.0,
    "radeon 780m": 90.0,
    "radeon 760m": 90.0,
    "radeon 680m": 80.0,
    "radeon 660m": 70.0,
    "arc 140v": 136.0,
    "arc 130v": 136.0,
    "arc graphics": 90.0,
    "iris xe": 68.0,
    "uhd graphics": 50.0,
}

# Typical achievable CPU bandwidth by platform family (dual channel unless noted).
CPU_GBS: list[tuple[str, float, str]] = [
    (r"epyc 9\d{3}", 300.0, "EPYC 9004, 12-channel DDR5"),
    (r"epyc 7\d{2}3", 150.0, "EPYC 7003, 8-channel DDR4"),
    (r"epyc 7\d{2}2", 140.0, "EPYC 7002, 8-channel DDR4"),
    (r"epyc", 120.0, "EPYC, 8-channel DDR4"),
    (r"xeon.*(platinum|gold) \d{4}", 120.0, "Xeon Scalable, 6/8-channel DDR4/DDR5"),
    (r"threadripper", 90.0, "Threadripper, quad-channel"),
    (r"ryzen (ai )?\d? ?(hx )?3\d{2}|ryzen ai max", 110.0, "Ryzen AI (LPDDR5X)"),
    (r"ryzen \d+ (7|8|9)\d{3}", 65.0, "Ryzen 7000/8000/9000, dual-channel DDR5"),
    (r"ryzen", 40.0, "Ryzen, dual-channel DDR4"),
    (r"core\(tm\) ultra|core ultra", 90.0, "Core Ultra (LPDDR5X / DDR5)"),
    (r"i[3579]-1[234]\d{3}", 60.0, "Core 12th-14th gen, DDR5/DDR4"),
    (r"i[3579]-\d{4,5}", 35.0, "Core, dual-channel DDR4"),
    (r"neoverse|graviton|ampere", 150.0, "Arm server, multi-channel DDR"),
]
DEFAULT_CPU_GBS = 30.0


_NOISE = re.compile(r"\b(nvidia|geforce|amd|ati|radeon|instinct|tesla|quadro|intel)\b|\[|\]")


def _normalise(name: str) -> str:
    """Lower case without vendor words and marks, so "NVIDIA GeForce RTX 3090" and "rtx 3090" compare equal,
    and "Intel(R) Arc(tm) A770 Graphics" and "arc a770"."""
    text = re.sub(r"\((r|tm)\)", " ", name.lower())
    return re.sub(r"\s+", " ", _NOISE.sub(" ", text)).strip()


def _lookup(table: dict[str, float], name: str) -> float | None:
    text = _normalise(name)
    for key in sorted(table, key=len, reverse=True):
        if re.search(rf"(^|[^a-z0-9]){re.escape(_normalise(key))}($|[^a-z0-9])", text):
            return table[key]
    return None


def apple_bandwidth(chip: str) -> float | None:
    """`chip` as macOS names it ("Apple M2 Pro")."""
    return _lookup(APPLE_GBS, chip)


def gpu_bandwidth(name: str) -> float | None:
    """An NVIDIA, AMD or Intel card by its marketing name, as nvidia-smi, rocm-smi or Vulkan print it."""
    return _lookup(NVIDIA_GBS, name) or _lookup(AMD_GBS, name) or _lookup(INTEL_GBS, name)


def integrated_bandwidth(name: str, cpu_model: str) -> tuple[float, str]:
    """An integrated GPU's figure: its chip's usual memory, else the CPU's (it is the same memory)."""
    gbs = _lookup(INTEGRATED_GBS, name)
    if gbs is not None:
        return gbs, f"{name}, the system memory it usually ships with"
    gbs, why = cpu_bandwidth(cpu_model)
    return gbs, f"shares the system memory: {why}"


def cpu_bandwidth(model: str) -> tuple[float, str]:
    """A typical figure for the CPU's platform, and what it assumes (always an estimate)."""
    text = model.lower()
    for pattern, gbs, why in CPU_GBS:
        if re.search(pattern, text):
            return gbs, why
    return DEFAULT_CPU_GBS, "unknown CPU platform; typical dual-channel DDR4"
