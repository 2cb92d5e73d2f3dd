"""RAMDeck's one change to llama.cpp's source (builds/rpc_threshold.py): the RPC cache threshold lowered from
10 MiB to 256 KiB, made by the same sh script on every POSIX node, idempotent, and refused on a tree whose
line is not upstream's."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

from builds import rpc_threshold
from llamacpp.rpc_cache import HASH_THRESHOLD

# The lines around the threshold in the pinned ggml-rpc.cpp, as they are there.
UPSTREAM = """// Try RPC_CMD_SET_TENSOR_HASH first when data size is larger than this threshold
const size_t HASH_THRESHOLD = 10 * 1024 * 1024;

static bool rpc_use_hash_cache(const ggml_tensor * tensor, size_t size) {
    return size > HASH_THRESHOLD && tensor->buffer->usage == GGML_BACKEND_BUFFER_USAGE_WEIGHTS;
}
"""


def _tree(tmp_path: Path, text: str) -> Path:
    source = tmp_path / rpc_threshold.RPC_SOURCE
    source.parent.mkdir(parents=True)
    source.write_text(text)
    return tmp_path


def _run_script(tree: Path) -> str:
    result = subprocess.run(rpc_threshold.script_argv(str(tree)), capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_the_patched_line_states_the_consoles_threshold():
    assert HASH_THRESHOLD == 256 * 1024
    assert rpc_threshold.PATCHED_LINE == "const size_t HASH_THRESHOLD = 256 * 1024;"


@pytest.mark.parametrize("apply", ["script", "python"])
def test_the_threshold_is_lowered_once_and_nothing_else_changes(tmp_path, apply):
    tree = _tree(tmp_path, UPSTREAM)
    run = _run_script if apply == "script" else rpc_threshold.patch_tree
    assert run(tree) == "patched"
    text = (tree / rpc_threshold.RPC_SOURCE).read_text()
    assert text == UPSTREAM.replace("10 * 1024 * 1024;", "256 * 1024;")
    assert run(tree) == "already"
    assert (tree / rpc_threshold.RPC_SOURCE).read_text() == text
    assert not list((tree / rpc_threshold.RPC_SOURCE).parent.glob("*.ramdeck"))


@pytest.mark.parametrize("apply", ["script", "python"])
def test_a_tree_whose_line_is_not_upstreams_is_left_alone(tmp_path, apply):
    other = UPSTREAM.replace("10 * 1024 * 1024", "4 * 1024 * 1024")
    tree = _tree(tmp_path, other)
    run = _run_script if apply == "script" else rpc_threshold.patch_tree
    assert run(tree) == "unknown"
    assert (tree / rpc_threshold.RPC_SOURCE).read_text() == other
    assert "left as it is" in rpc_threshold.outcome_message("unknown")


def test_the_pinned_source_has_the_line_the_patch_expects():
    """Against the real pinned ggml-rpc.cpp, read from the pinned tarball (fetched when missing): a new pin
    whose line moved must fail here, not at a node."""
    from tests import llamacpp_build

    with tarfile.open(llamacpp_build.require_tarball()) as tar:
        [member] = [m for m in tar.getmembers() if m.name.endswith("/llama.cpp/" + rpc_threshold.RPC_SOURCE)]
        text = tar.extractfile(member).read().decode()
    assert rpc_threshold.patch_text(text) == text.replace(
        rpc_threshold.UPSTREAM_LINE, rpc_threshold.PATCHED_LINE
    )
    assert text.count(rpc_threshold.UPSTREAM_LINE) == 1
