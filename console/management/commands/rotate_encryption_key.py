"""Re-encrypt every stored secret with the newest key in RAMDECK_ENCRYPTION_KEYS."""

from __future__ import annotations

from django.core.management.base import BaseCommand
from django.db import transaction

from deployments.models import Deployment
from nodes.models import Credential
from ramdeck_site import crypto


class Command(BaseCommand):
    help = (
        "Re-encrypt all secrets with the first key of RAMDECK_ENCRYPTION_KEYS. "
        "Put a new key first, keep the old ones after it, run this, then drop the old keys."
    )

    def add_arguments(self, parser):
        parser.add_argument("--generate", action="store_true", help="Only print a new key to put first.")

    def handle(self, *args, generate: bool, **options):
        if generate:
            self.stdout.write(crypto.generate_key())
            return
        with transaction.atomic():
            credentials = list(Credential.objects.select_for_update())
            for credential in credentials:
                credential.rotate_encryption()
            deployments = list(Deployment.objects.select_for_update().exclude(api_key_encrypted=""))
            for deployment in deployments:
                deployment.api_key_encrypted = crypto.rotate(deployment.api_key_encrypted)
                deployment.save(update_fields=["api_key_encrypted"])
        self.stdout.write(
            self.style.SUCCESS(
                f"Re-encrypted {len(credentials)} credential(s) and {len(deployments)} API key(s)."
            )
        )
