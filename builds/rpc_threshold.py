"""The one line RAMDeck changes in llama.cpp before building it: the size above which a weight tensor is
offered to an rpc-server's cache by hash instead of being sent.

In ggml-rpc.cpp (ggml/src/ggml-rpc/) llama-server, the RPC *client*, asks a worker's rpc-server whether it
holds a tensor (by an FNV-1a hash of its bytes) only when the tensor is larger than HASH_THRESHOLD, 10 MiB
upstream; smaller tensors cross the network at every load. That leaves much of a real model outside the
cache: a 7B model quantised to Q4 has attention matrices of 9 MiB, 11 to 22% of its weights, and the lab's
7B-shaped model 4% (issue 20 asks that a warm load send under 5%). RAMDeck's builds lower it to 256 KiB:
below that only norms and biases are left (well under 1% of any real model), and a tensor that small takes
about as long to send on a 100 Mbit/s link (21 ms) as the hash round trip it would cost.

Only the client decides: an rpc-server with `-c` saves whatever tensor it is asked to cache and looks up any
hash it is offered, whatever its own build's threshold. So an unpatched worker still takes a patched
coordinator's small tensors into its cache, and an unpatched coordinator (a node's existing install) loads
as upstream does.

The change is made by a POSIX sh script on the node (sed into a temporary file, then moved over: GNU and BSD
sed alike), idempotent, and a tree whose line differs from upstream's (another llama.cpp) is left as it is
and said so.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from llamacpp.rpc_cache import HASH_THRESHOLD as THRESHOLD

RPC_SOURCE = posixpath.join("ggml", "src", "ggml-rpc", "ggml-rpc.cpp")
UPSTREAM_LINE = "const size_t HASH_THRESHOLD = 10 * 1024 * 1024;"
PATCHED_LINE = f"const size_t HASH_THRESHOLD = {THRESHOLD // 1024} * 1024;"

# The sed expression; the demo node image uses the same (compose/demo-node/install-llamacpp.sh).
SED_EXPR = f"s/^{UPSTREAM_LINE.replace('*', '\\*')}/{PATCHED_LINE}/"
# $1: the llama.cpp tree. Prints one word: "patched", "already" or "unknown" (the line is not upstream's).
SCRIPT = f"""
set -eu
f=$1/{RPC_SOURCE}
if grep -qF '{PATCHED_LINE}' "$f"; then echo already
elif grep -qF '{UPSTREAM_LINE}' "$f"; then
  sed '{SED_EXPR}' "$f" > "$f.ramdeck"
  cat "$f.ramdeck" > "$f" && rm -f "$f.ramdeck"
  echo patched
else echo unknown
fi
"""


def script_argv(tree: str) -> list[str]:
    return ["sh", "-c", SCRIPT, "rpc-threshold", tree]


def outcome_message(outcome: str) -> str:
    """The build log's line for what SCRIPT printed."""
    if outcome == "patched":
        return (
            f"RPC cache threshold lowered to {THRESHOLD // 1024} KiB (upstream 10 MiB), so a warm load sends "
            "almost nothing: builds/rpc_threshold.py"
        )
    if outcome == "already":
        return f"RPC cache threshold already {THRESHOLD // 1024} KiB in this tree"
    return (
        "this llama.cpp's HASH_THRESHOLD line is not the one RAMDeck knows, so it was left as it is: tensors "
        "below its threshold will cross the network at every load, and load predictions assume "
        f"{THRESHOLD // 1024} KiB"
    )


def patch_text(text: str) -> str | None:
    """`text` (ggml-rpc.cpp) with the threshold lowered; unchanged when already lowered; None when the line
    is not upstream's."""
    if PATCHED_LINE in text:
        return text
    if UPSTREAM_LINE not in text:
        return None
    return text.replace(UPSTREAM_LINE, PATCHED_LINE, 1)


def patch_tree(tree: Path) -> str:
    """SCRIPT's work in Python, for a tree on this machine (the tests' build): its outcome word."""
    source = tree / RPC_SOURCE
    text = source.read_text()
    patched = patch_text(text)
    if patched is None:
        return "unknown"
    if patched == text:
        return "already"
    source.write_text(patched)
    return "patched"
