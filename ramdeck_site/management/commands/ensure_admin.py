"""Make sure an admin account exists; print its login the first time only."""

from __future__ import annotations

import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.db.models import Q


class Command(BaseCommand):
    help = "Create the first admin (password from RAMDECK_ADMIN_PASSWORD, or generated and printed once)."

    def add_arguments(self, parser):
        parser.add_argument("--username", default=os.environ.get("RAMDECK_ADMIN_USER", "admin"))

    def handle(self, *args, username: str, **options):
        User = get_user_model()
        admin_group = Group.objects.get(name="admin")
        admins = User.objects.filter(Q(is_superuser=True) | Q(groups=admin_group)).distinct()
        if admins.exists():
            self._refuse_published_passwords(admins)
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

    def _refuse_published_passwords(self, admins) -> None:
        """An admin whose password was once a published default (an old compose trial's volume) stops the
        start: anyone could log in as them."""
        published = settings.PUBLISHED_SECRETS["RAMDECK_ADMIN_PASSWORD"]
        weak = [user.get_username() for user in admins for p in published if user.check_password(p)]
        if weak:
            raise CommandError(
                f"Admin account(s) {', '.join(sorted(weak))} still use a password published in RAMDeck's "
                "repository (an old docker-compose.yml default). Set a new one first: "
                "manage.py changepassword <username>."
            )
