"""WSL2: recognising a Linux node that runs inside Windows, and what its Windows side needs (pure, no Django).

WSL2 runs Linux in a small VM. In its default NAT networking the VM has a private address of its own (from
172.16.0.0/12, new at every WSL start), which other machines cannot reach: Windows must forward the port to it
(`netsh interface portproxy`) and its firewall must let the port in. Mirrored networking
(`.wslconfig`: `[wsl2]` `networkingMode=mirrored`, Windows 11 22H2 and later) gives the VM Windows' own
addresses instead, so no forward is needed; Hyper-V's firewall then decides what comes in.

The probe script (nodes/probe/script.py) prints a `wsl` section on a WSL kernel: `run_wsl=yes` when /run/WSL
exists, `interop=yes` when WSL_INTEROP is set, `networking_mode=` from `wslinfo --networking-mode`, and
`addresses=` from `hostname -I` (or `ip -4 -o addr`, one or more lines) last.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from llamacpp.rpc_reach import firewall_fix

NETWORKING_MODES = ("nat", "mirrored", "virtioproxy", "none")
# With DNS tunnelling (on by default in recent WSL) this address sits on the VM's loopback interface and
# `hostname -I` lists it: it is not where Windows can forward to.
DNS_TUNNEL_ADDRESS = "10.255.255.254"
# Hyper-V's id of WSL's VMs, which its firewall rules for WSL name (Microsoft's WSL networking guide).
WSL_VM_CREATOR_ID = "{40E0AC32-46A5-438A-A0B2-2B479E8F2E90}"
WSLCONFIG = "[wsl2]\nnetworkingMode=mirrored"


def _key_values(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and key.strip() not in values:
            values[key.strip()] = value.strip()
    return values


def wsl_addresses(section: str) -> list[str]:
    """The VM's IPv4 addresses from the text after `addresses=`, in order (loopback, link-local and WSL's DNS
    tunnel address left out)."""
    _, _, tail = section.partition("addresses=")
    found = []
    for candidate in re.findall(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?:/\d+)?(?![\d.])", tail):
        try:
            address = ipaddress.IPv4Address(candidate)
        except ValueError:
            continue
        if address.is_loopback or address.is_link_local or candidate == DNS_TUNNEL_ADDRESS:
            continue
        if candidate not in found:
            found.append(candidate)
    return found


def parse_wsl(sections: dict[str, str], kernel: str) -> dict:
    """{"version": 2, "networking_mode": "nat", "address": "172.28.1.2"} on WSL, {} elsewhere.

    WSL needs both signs: a Microsoft kernel (uname -r, /proc/sys/kernel/osrelease or /proc/version name
    "microsoft"; WSL2's say "microsoft-standard-WSL2") and WSL's own traces (/run/WSL or WSL_INTEROP). The
    kernel alone is a Docker Desktop container too. WSL 1 has no VM (Windows' own kernel answers Linux calls,
    as "4.4.0-…-Microsoft"), so it shares Windows' network and needs no forward."""
    kernel_text = " ".join((kernel, sections.get("osrelease", ""), sections.get("proc-version", ""))).lower()
    if "microsoft" not in kernel_text and "wsl" not in kernel_text:
        return {}
    section = sections.get("wsl", "")
    values = _key_values(section)
    if values.get("run_wsl") != "yes" and values.get("interop") != "yes":
        return {}
    version = 2 if ("wsl2" in kernel_text or "microsoft-standard" in kernel_text) else 1
    mode = values.get("networking_mode", "").strip().lower()
    addresses = wsl_addresses(section)
    return {
        "version": version,
        "networking_mode": mode if mode in NETWORKING_MODES else "",
        "address": addresses[0] if addresses else "",
    }


@dataclass(frozen=True)
class WindowsSide:
    """What to run on the Windows side of a WSL node (an administrator's PowerShell or cmd), each line built
    with the node's own ports."""

    version: int
    networking_mode: str  # "nat", "mirrored", ... or "" when wslinfo did not say
    address: str  # the VM's address, "" when unknown
    rpc_port: int
    ssh_port: int

    @property
    def mirrored(self) -> bool:
        return self.networking_mode == "mirrored"

    @property
    def needs_forward(self) -> bool:
        """WSL2 in NAT networking (or a mode wslinfo did not name: NAT is the default)."""
        return self.version == 2 and not self.mirrored

    @property
    def connect_address(self) -> str:
        return self.address or "<WSL address>"

    def port_forward(self, port: int) -> str:
        return (
            f"netsh interface portproxy add v4tov4 listenport={port} listenaddress=0.0.0.0 "
            f"connectport={port} connectaddress={self.connect_address}"
        )

    def remove_forward(self, port: int) -> str:
        return f"netsh interface portproxy delete v4tov4 listenport={port} listenaddress=0.0.0.0"

    @staticmethod
    def firewall_rule(port: int) -> str:
        return (
            f'netsh advfirewall firewall add rule name="RAMDeck TCP {port}" dir=in action=allow '
            f"protocol=TCP localport={port}"
        )

    @property
    def rpc_forward(self) -> str:
        return self.port_forward(self.rpc_port)

    @property
    def remove_rpc_forward(self) -> str:
        return self.remove_forward(self.rpc_port)

    @property
    def rpc_firewall_rule(self) -> str:
        """The same rule the deployment's preflight names when a Windows worker's port is closed."""
        return firewall_fix("windows", "", self.rpc_port)

    @property
    def ssh_forward(self) -> str:
        return self.port_forward(self.ssh_port)

    @property
    def ssh_firewall_rule(self) -> str:
        return self.firewall_rule(self.ssh_port)

    @staticmethod
    def hyperv_rule_for(port: int, name: str) -> str:
        """Mirrored networking: Hyper-V's firewall admits `port` into WSL's VM (PowerShell)."""
        return (
            f'New-NetFirewallHyperVRule -Name "RAMDeck-{name}-{port}" -DisplayName "RAMDeck {name} {port}" '
            f'-Direction Inbound -VMCreatorId "{WSL_VM_CREATOR_ID}" -Protocol TCP -LocalPorts {port} '
            "-Action Allow"
        )

    @property
    def hyperv_rule(self) -> str:
        return self.hyperv_rule_for(self.rpc_port, "RPC")

    @property
    def ssh_hyperv_rule(self) -> str:
        return self.hyperv_rule_for(self.ssh_port, "SSH")

    wslconfig = WSLCONFIG


def windows_side(wsl: dict | None, *, rpc_port: int, ssh_port: int) -> WindowsSide | None:
    """The Windows side of a node whose probe found WSL (its stored `facts["wsl"]`), or None. What the node
    printed is read again here: only a real IPv4 address becomes part of a command line."""
    if not isinstance(wsl, dict) or not wsl:
        return None
    version = wsl.get("version")
    mode = wsl.get("networking_mode")
    address = wsl.get("address")
    found = wsl_addresses(f"addresses={address}") if isinstance(address, str) else []
    return WindowsSide(
        version=version if version in (1, 2) else 2,
        networking_mode=mode if mode in NETWORKING_MODES else "",
        address=found[0] if found else "",
        rpc_port=int(rpc_port),
        ssh_port=int(ssh_port),
    )
