"""Versions and protocol lines of llama.cpp: the RPC protocol a source tree or a banner speaks, and whether
two builds can serve one deployment."""

from __future__ import annotations

import re


def parse_rpc_protocol_header(text: str) -> str:
    """ "7.0.0" from ggml-rpc.h's RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION defines; "" when absent."""
    parts = []
    for what in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"#define\s+RPC_PROTO_{what}_VERSION\s+(\d+)", text)
        if not match:
            return ""
        parts.append(match.group(1))
    return ".".join(parts)


def rpc_target_of(cmakelists: str) -> str:
    """The RPC server's CMake target in this source tree: ggml-rpc-server, or rpc-server in older releases."""
    return "ggml-rpc-server" if "ggml-rpc-server" in cmakelists else "rpc-server"


def src_dir_name(sha256: str) -> str:
    return f"src-{sha256[:16]}"


def protocol_mismatch(builds: dict[str, str]) -> str:
    """A reason to refuse when nodes' RPC protocol versions differ ({node: "7.0.0"}), else ""."""
    distinct = sorted(set(builds.values()))
    if len(distinct) <= 1:
        return ""
    listing = ", ".join(
        f"{node} speaks {proto or 'an unknown version'}" for node, proto in sorted(builds.items())
    )
    return (
        f"The nodes' llama.cpp builds speak different RPC protocol versions ({listing}); rebuild them alike."
    )
