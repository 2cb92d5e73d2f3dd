"""The demo node's image builds llama.cpp from the same pinned source the console uploads to nodes: its
Dockerfile's build arguments are llamacpp/source.py's PINNED, so a new pin cannot leave the trial behind."""

from __future__ import annotations

import re

from llamacpp.source import PINNED
from tests.compose.stack import DEMO_NODE_DIR


def _build_args() -> dict[str, str]:
    dockerfile = (DEMO_NODE_DIR / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (LLAMACPP_\w+)=(\S+)$", dockerfile, re.M))


def test_the_demo_node_builds_the_pinned_llamacpp_source():
    assert _build_args() == {
        "LLAMACPP_PACKAGE": PINNED.package,
        "LLAMACPP_VERSION": PINNED.version,
        "LLAMACPP_SHA256": PINNED.sha256,
    }


def test_the_demo_node_builds_with_the_consoles_cpu_flags():
    from builds.job import cmake_flags

    script = (DEMO_NODE_DIR / "install-llamacpp.sh").read_text()
    for flag in cmake_flags("cpu"):
        assert flag in script, f"install-llamacpp.sh lacks {flag}, which the console's own CPU build sets"


def test_the_demo_node_leaves_amx_out_where_the_cpu_faults_on_it_as_the_build_job_does():
    from builds.amx import AMX_CHECK_C, NO_AMX

    assert (DEMO_NODE_DIR / "amx-check.c").read_text().strip() == AMX_CHECK_C.strip()
    script = (DEMO_NODE_DIR / "install-llamacpp.sh").read_text()
    assert f'no_amx="{NO_AMX}"' in script
    assert '-DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx"' in script
    assert "amx-check.c" in (DEMO_NODE_DIR / "Dockerfile").read_text()


def test_the_demo_node_lowers_the_rpc_cache_threshold_as_the_build_job_does():
    from builds.rpc_threshold import RPC_SOURCE, SED_EXPR

    script = (DEMO_NODE_DIR / "install-llamacpp.sh").read_text()
    assert f"sed '{SED_EXPR}' \"$rpc\"" in script
    assert f'rpc="$tree/{RPC_SOURCE}"' in script
