"""What the builds form checks on the node itself before a build job starts (deployments/views/run.py).

A folder that holds no llama.cpp build, or a git URL or ref the node cannot fetch, is a form error with the
reason, not a job that fails minutes later with a bare exit status. The checks run over the node's own
transport (SSH, or the console's host for a Local node), as the model register view reads GGUF headers.
"""

from __future__ import annotations

import asyncio
import re

from asgiref.sync import sync_to_async

from llamacpp.args import RPC_SERVER_BINARIES
from nodes.models import Node
from nodes.transports import transport_for
from remote.base import TransportError

# The whole check (connect and command) waits at most this long for a node.
CHECK_TIMEOUT_S = 45.0

# Prints one word: nodir, noserver, norpc or ok (the folder is $1, the RPC binary names follow).
_INSTALL_SCRIPT = r"""
d=$1; shift
[ -d "$d" ] || { echo nodir; exit 0; }
[ -x "$d/llama-server" ] || { echo noserver; exit 0; }
for n in "$@"; do [ -x "$d/$n" ] && { echo ok; exit 0; }; done
echo norpc
"""

# A commit named by its hash is fetched, but not listed by `git ls-remote`.
_COMMIT = re.compile(r"[0-9a-f]{7,40}")


def _install_problem(answer: str, node: Node, path: str) -> str | None:
    return {
        "nodir": f"There is no folder {path} on {node.name}.",
        "noserver": f"{path} on {node.name} holds no llama-server: give the folder of a llama.cpp build's "
        "binaries (such as build/bin).",
        "norpc": f"{path} on {node.name} holds llama-server but no ggml-rpc-server: that build has no RPC "
        "support (llama.cpp built with -DGGML_RPC=ON has it).",
        "ok": None,
    }.get(answer, f"Could not look into {path} on {node.name}.")


def _git_problem(result, node: Node, url: str, ref: str) -> tuple[str, str] | None:
    """(field, message) when `git ls-remote URL REF` says the build could not fetch them."""
    if result.exit_status == 127:
        return "git_url", f"git is not installed on {node.name}: install it, or build from a tarball."
    if not result.ok:
        said = [line.text.strip() for line in result.lines if line.stream == "err" and line.text.strip()]
        reason = said[-1] if said else f"exit status {result.exit_status}"
        return "git_url", f"{node.name} could not read the repository at {url}: {reason}"
    if not result.stdout.strip() and not _COMMIT.fullmatch(ref):
        return "git_ref", f"The repository at {url} has no branch or tag named {ref}."
    return None


async def _check(node: Node, params: dict) -> dict[str, str]:
    transport = await sync_to_async(transport_for)(node)
    async with transport:
        if params["source"] == "existing":
            result = await transport.run(
                ["sh", "-c", _INSTALL_SCRIPT, "sh", params["path"], *RPC_SERVER_BINARIES], timeout=30
            )
            problem = _install_problem(result.stdout.strip(), node, params["path"])
            return {"path": problem} if problem else {}
        if params["source"] == "git":
            url, ref = params["git_url"], params["git_ref"]
            # No prompt for a password or a host key: a form cannot answer one.
            argv = ["env", "GIT_TERMINAL_PROMPT=0", "GIT_SSH_COMMAND=ssh -o BatchMode=yes",
                    "git", "ls-remote", "--", url, ref]  # fmt: skip
            result = await transport.run(argv, timeout=CHECK_TIMEOUT_S - 5)
            problem = _git_problem(result, node, url, ref)
            return {problem[0]: problem[1]} if problem else {}
    return {}


async def source_problems(node: Node, params: dict) -> dict[str, str]:
    """Form errors (field: message) for a build source the node cannot use; {} when it can, or when the
    source is a tarball (the console checks those itself)."""
    if node.platform == "windows":
        # The build job checks the folder, or CMake, the compiler, tar and git, itself in PowerShell and names
        # what is missing with the winget and Chocolatey commands that install it (builds/windows.py).
        return {}
    if params["source"] not in ("existing", "git"):
        return {}
    field = "path" if params["source"] == "existing" else "git_url"
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            return await _check(node, params)
    except TimeoutError:
        return {field: f"{node.name} did not answer within {CHECK_TIMEOUT_S:g} s; try again when it is up."}
    except (TransportError, OSError) as exc:
        return {field: f"Could not check this on {node.name}: {exc}"}
