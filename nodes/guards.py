"""What keeps a worker's ggml-rpc-server to its one peer: the address a direct one binds, and the
firewall rule (and whether the SSH user may set it) and the tunnel key's line, put in and taken out over
the node's transport."""

from __future__ import annotations

from jobs.context import JobFailed
from llamacpp import rpc_guard
from nodes.models import Node
from remote.powershell import firewall_remove_script, powershell_argv


async def may_administer(ctx, rule: list[str]) -> bool | None:
    """How the SSH user may insert and delete the firewall rule `rule`: False as root, True through
    `sudo -n`, None: it may not. With sudo, exactly those two iptables commands are checked (`sudo -n -l`,
    which runs nothing), so a sudoers line that allows only them (rpc_guard.SUDOERS_LINE) is enough."""
    if (await ctx.transport.run(["id", "-u"], timeout=30)).stdout.strip() == "0":
        return False
    # A node without sudo at all answers no (the transport reports a missing program as an error).
    if not (await ctx.transport.run(["sh", "-c", "command -v sudo"], timeout=30)).ok:
        return None
    for action in ("-I", "-D"):
        if not (await ctx.transport.run(rpc_guard.sudo_allows_argv(action, rule), timeout=30)).ok:
            return None
    return True


async def remove_guard(ctx, info: dict) -> str:
    """Undo one guard (an authorized key, a firewall rule); removing one already gone is fine."""
    if info["kind"] == "authorized-key":
        # Exactly the lines this deployment wrote (under the file's lock); a guard recorded by an older
        # console, before the lines were, goes by its tag.
        lines = info.get("lines")
        argvs = (
            [rpc_guard.remove_line_argv(info["path"], line) for line in lines]
            if lines
            else [rpc_guard.remove_tagged_argv(info["path"], info["tag"])]
        )
        for argv in argvs:
            result = await ctx.transport.run(argv, timeout=90)
            if not result.ok:
                why = "; ".join(line.text for line in result.lines[-3:] if line.text)
                raise JobFailed(
                    f"could not remove the tunnel key {info['tag']} from {info['path']}"
                    + (f": {why}" if why else "")
                )
        return f"tunnel key {info['tag']} removed from {info['path']}"
    if info["kind"] == "firewall":
        removed = 0
        for _ in range(10):  # the same rule added twice (a retried step) is removed twice
            argv = rpc_guard.iptables_argv("-D", info["rule"], sudo=info.get("sudo", False))
            if not (await ctx.transport.run(argv, timeout=60)).ok:
                break
            removed += 1
        return f"firewall rule {info['tag']} removed" if removed else f"firewall rule {info['tag']} was gone"
    if info["kind"] == "windows-firewall":
        result = await ctx.transport.run(powershell_argv(firewall_remove_script(info["tag"])), timeout=60)
        if not result.ok:
            raise JobFailed(f"could not remove the Windows Firewall rules {info['tag']}")
        return f"firewall rule {info['tag']} removed"
    return f"unknown guard {info['kind']} left alone"


def direct_bind(node: Node) -> str:
    """The normalised IPv4 a direct rpc-server binds (raises rpc_guard.BindRefused)."""
    return rpc_guard.normalise_bind(
        node.rpc_bind_host, allow_unspecified=rpc_guard.binds_everywhere(node.rpc_bind_address)
    )


def ipv4_of(node: Node) -> str | None:
    """The node's IPv4 address (resolved from its name), or None."""
    try:
        return rpc_guard.normalise_bind(node.address)
    except rpc_guard.BindRefused:
        return None
