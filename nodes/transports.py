"""How the console reaches a Node: the local transport for the console's own host, else SSH bound to the
node's row (credentials decrypted at connect time, refused host keys and connection failures recorded on
the node for the node page). Registered with jobs/aio.py in NodesConfig.ready(): jobs reach their nodes
without importing this app."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings

from nodes.models import CredentialKind, Node
from remote.base import HostKeyChanged, HostKeyUnknown, Transport, TransportError
from remote.local import LocalTransport
from remote.ssh import SSHTarget, SSHTransport


def transport_for(node) -> Transport:
    """The transport for a Node row (not yet connected: use it with `async with`).

    Call from synchronous code (or through sync_to_async): it reads the node's credential from the database.
    """
    if node.is_local:
        return LocalTransport(
            command_timeout=settings.RAMDECK_COMMAND_TIMEOUT_S,
            output_limit=settings.RAMDECK_COMMAND_OUTPUT_MAX_BYTES,
        )
    return NodeSSHTransport(target_for_node(node), node.pk)


class NodeSSHTransport(SSHTransport):
    """An SSHTransport for a Node row: a refused host key is stored on the node as pending, and a failed
    connection marks the node unreachable with the reason (a person reads it on the node page)."""

    def __init__(self, target: SSHTarget, node_pk: int) -> None:
        super().__init__(target)
        self.node_pk = node_pk

    async def connect(self) -> None:
        try:
            await super().connect()
        except (HostKeyUnknown, HostKeyChanged) as exc:
            await sync_to_async(_record_offered_key)(self.node_pk, exc)
            raise
        except TransportError as exc:
            await sync_to_async(_record_unreachable)(self.node_pk, str(exc))
            raise


def _record_offered_key(node_pk: int, exc: HostKeyUnknown | HostKeyChanged) -> None:
    Node(pk=node_pk).record_offered_host_key(
        exc.offered_key, exc.fingerprint, changed=isinstance(exc, HostKeyChanged), message=str(exc)
    )


def _record_unreachable(node_pk: int, message: str) -> None:
    Node(pk=node_pk).mark_unreachable(message)


def shell_for(node) -> str:
    """ "windows" or "posix" once a probe found the node's platform (what its first connection and probe
    found, not the operator's hint: `Node.platform`); "" before that: the transport tells the shells apart
    at this first connection, and the probe checks its answer against the operator's setting."""
    if (node.facts or {}).get("platform") not in ("linux", "macos", "windows"):
        return ""
    return "windows" if node.platform == "windows" else "posix"


def target_for_node(node) -> SSHTarget:
    """Connection details for a Node; the credential is decrypted here, at connect time, and nowhere else."""

    target = SSHTarget(
        host=node.address,
        port=node.ssh_port,
        username=node.ssh_user or "root",
        pinned_host_key=node.host_key,
        connect_timeout=settings.RAMDECK_SSH_CONNECT_TIMEOUT_S,
        keepalive_interval=settings.RAMDECK_SSH_KEEPALIVE_S,
        command_timeout=settings.RAMDECK_COMMAND_TIMEOUT_S,
        output_limit=settings.RAMDECK_COMMAND_OUTPUT_MAX_BYTES,
    )
    target.shell = shell_for(node)
    credential = node.credential
    if credential is None:
        raise TransportError(
            f"Node {node.name} has no credential: add a password or private key to reach it."
        )
    if credential.kind == CredentialKind.PRIVATE_KEY:
        target.private_key, target.passphrase = credential.secret(), credential.passphrase() or None
    else:
        target.password = credential.secret()
    return target
