"""Make sure an admin account exists; print its login the first time only."""

from __future__ import annotations

import os
import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand
from django.db import transaction


class Command(BaseCommand):
    help = "Create the first admin (password from RAMDECK_ADMIN_PASSWORD, or generated and printed once)."

    def add_arguments(self, parser):
        parser.add_argument("--username", default=os.environ.get("RAMDECK_ADMIN_USER", "admin"))

    def handle(self, *args, username: str, **options):
        User = get_user_model()
        admin_group = Group.objects.get(name="admin")
        if User.objects.filter(is_superuser=True).exists() or admin_group.user_set.exists():
            self.stdout.write(f"An admin account exists already (log in as it, e.g. {username!r}).")
            return
        password = os.environ.get("RAMDECK_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        with transaction.atomic():
            user = User.objects.create_superuser(username=username, email="", password=password)
            user.groups.add(admin_group)
        if os.environ.get("RAMDECK_ADMIN_PASSWORD"):
            self.stdout.write(
                f"Created admin account {username!r} with the password from RAMDECK_ADMIN_PASSWORD."
            )
        else:
            self.stdout.write(
                self.style.WARNING(
                    f"Created admin account {username!r} with password: {password}\n"
                    "It is shown this once; change it after logging in (Password, top right)."
                )
            )
