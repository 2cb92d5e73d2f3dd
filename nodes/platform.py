"""Which operating system a node runs, as the console must know it to build its commands."""

from __future__ import annotations


def node_platform(node) -> str:
    """ "linux", "macos" or "windows": the operator's hint, else what the probe found."""
    if node.platform_hint and node.platform_hint != "auto":
        return node.platform_hint
    facts = node.facts or {}
    text = " ".join(str(facts.get(key, "")) for key in ("platform", "os", "system", "os_name")).lower()
    if "darwin" in text or "mac" in text:
        return "macos"
    if "windows" in text:
        return "windows"
    return "linux"
