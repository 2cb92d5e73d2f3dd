"""Prepare the docker compose trial: demo nodes registered with a key they accept, their host keys waiting
for an admin's approval. The demo nodes carry llama.cpp (compose/demo-node), which their first probe finds
and records; the model is the small real one the Models page offers (modelfiles/real_model.py), which
replaced the generated one with random weights that this command used to register.

docker-compose.yml runs it in the web service on every start. Each step looks at what exists first, so a
restart changes nothing that is already there: not the key, not an admin's edits to the nodes, not an
approved host key.

The key pair is generated here, on first start: the private half is stored encrypted like any credential,
the public half is written to `<share>/authorized_keys`, which the demo nodes' sshd reads. Nothing secret
is fixed in a published file.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import asyncssh
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from audit import history
from nodes.models import Credential, CredentialKind, Node, Transport
from nodes.transports import NodeSSHTransport, target_for_node
from remote.base import HostKeyChanged, HostKeyUnknown, TransportError
from remote.ssh import SSHTarget

CREDENTIAL_NAME = "compose-demo-key"
ACTOR = "compose_demo"


class Command(BaseCommand):
    help = "Register the compose trial's demo nodes (their host keys pending approval)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--node",
            action="append",
            dest="nodes",
            required=True,
            help="A demo node's compose service name (its address on the compose network); repeat per node.",
        )
        parser.add_argument(
            "--share",
            required=True,
            help="The volume shared with the demo nodes, mounted at the same path on them: "
            "authorized_keys goes there.",
        )
        parser.add_argument(
            "--contact-timeout",
            type=float,
            default=90.0,
            help="Seconds to wait for the demo nodes' sshd on first contact (default 90).",
        )

    def handle(self, *args, nodes: list[str], share: str, contact_timeout: float, **options):
        share_dir = Path(share)
        if not share_dir.is_dir():
            raise CommandError(f"--share {share} is not a folder (is the demo volume mounted?).")
        credential = self._credential()
        _write_atomically(share_dir / "authorized_keys", _public_key_line(credential) + "\n", mode=0o644)
        # The first node may coordinate.
        demo_nodes = [self._node(name, credential, coordinator=i == 0) for i, name in enumerate(nodes)]
        first_contact = [n for n in demo_nodes if n.enabled and not (n.host_key or n.pending_host_key)]
        if first_contact:
            # Targets are built here: they read (and decrypt) the credential, which async code may not.
            targets = [(node.pk, target_for_node(node)) for node in first_contact]
            asyncio.run(_contact_all(targets, contact_timeout))
        for node in demo_nodes:
            node.refresh_from_db()
            if node.pending_host_key:
                self.stdout.write(
                    f"{node.name}: host key {node.pending_host_key_fingerprint} awaits approval on its node "
                    f"page (check it: docker compose exec {node.name} ssh-keygen -lf "
                    "/etc/ssh/ssh_host_ed25519_key.pub)."
                )
            elif node.host_key:
                self.stdout.write(f"{node.name}: host key {node.host_key_fingerprint} is approved.")
            else:
                self.stdout.write(f"{node.name}: not reached yet ({node.last_error or 'no answer'}).")

    # -- what is created once ------------------------------------------------------------------------

    def _credential(self) -> Credential:
        credential = Credential.objects.filter(name=CREDENTIAL_NAME).first()
        if credential is not None:
            return credential
        key = asyncssh.generate_private_key("ssh-ed25519", comment="ramdeck-compose-demo")
        with transaction.atomic():
            credential = Credential(name=CREDENTIAL_NAME, kind=CredentialKind.PRIVATE_KEY)
            credential.set_secret(key.export_private_key("openssh").decode())
            credential.public_fingerprint = key.get_fingerprint("sha256")
            credential.save()
            history.record(None, "credential.create", credential, actor_name=ACTOR)
        self.stdout.write(f"Generated the demo nodes' login key {credential.public_fingerprint}.")
        return credential

    def _node(self, name: str, credential: Credential, *, coordinator: bool) -> Node:
        node = Node.objects.filter(name=name).first()
        if node is not None:
            return node
        node = Node(
            name=name,
            address=name,
            transport=Transport.SSH,
            ssh_user="root",
            credential=credential,
            may_coordinate=coordinator,
            # ggml-rpc-server takes only an IPv4 address to bind to, and a container's address changes
            # whenever compose recreates it: the demo nodes listen on every interface of their container,
            # which only the compose network reaches (the port is not published).
            rpc_bind_address="0.0.0.0",
            # Their sshd reads the keys from the shared volume: deployments reach them directly (compose
            # network only), not through a tunnel whose key would have to go there.
            rpc_tunnel=False,
            notes="A demo node of the docker compose trial: a container on the console's machine, reached "
            "only over the compose network.",
        )
        node.full_clean()
        with transaction.atomic():
            node.save()
            history.record(
                None, "node.create", node, changes={"address": name, "demo": True}, actor_name=ACTOR
            )
        self.stdout.write(f"Registered demo node {name}.")
        return node


# -- first contact: the offered host keys become pending -------------------------------------------------


async def _contact_all(targets: list[tuple[int, SSHTarget]], timeout: float) -> None:
    await asyncio.gather(*(_first_contact(pk, target, timeout) for pk, target in targets))


async def _first_contact(node_pk: int, target: SSHTarget, timeout: float) -> None:
    """Connect until the node's sshd answers; the transport stores the key it offers as pending (nothing
    runs: no key is approved). Nodes that start slower than the console are waited for, up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        transport = NodeSSHTransport(target, node_pk)
        try:
            await transport.connect()
        except (HostKeyUnknown, HostKeyChanged):
            return
        except TransportError:
            if time.monotonic() >= deadline:
                return  # Recorded on the node (unreachable, with the reason); the next start tries again.
            await asyncio.sleep(1.0)
        else:  # pragma: no cover - an empty pin accepts no key, so a connection cannot be made.
            await transport.close()
            return


def _public_key_line(credential: Credential) -> str:
    key = asyncssh.import_private_key(credential.secret())
    return key.export_public_key("openssh").decode().strip()


def _write_atomically(path: Path, text: str, *, mode: int) -> None:
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(temporary, mode)
    os.replace(temporary, path)
