"""Give a compose trial's database, made by an older docker-compose.yml, its generated password.

Older docker-compose.yml files created the trial's database with the fixed password `ramdeck`, published in
this repository. PostgreSQL applies POSTGRES_PASSWORD_FILE only when it creates its data folder, so after an
upgrade the database would keep the published password while the console reads the generated one and could
not log in. docker-compose.yml runs this in the web service before `migrate`: when the generated password is
refused and the published one is accepted, the role's password becomes the generated one. In every other
case it changes nothing (and `migrate` reports a database it cannot reach).
"""

from __future__ import annotations

import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand
from psycopg import sql

# What the first docker-compose.yml set as POSTGRES_PASSWORD.
PUBLISHED_PASSWORD = "ramdeck"


class Command(BaseCommand):
    help = "Give the compose trial's database its generated password if it still has the published one."

    def handle(self, *args, **options):
        database = settings.DATABASES["default"]
        password = database.get("PASSWORD")
        if database["ENGINE"] != "django.db.backends.postgresql" or not password:
            return
        login = {
            "host": database["HOST"],
            "port": database["PORT"] or 5432,
            "user": database["USER"],
            "dbname": database["NAME"],
            "connect_timeout": 10,
        }
        try:
            psycopg.connect(**login, password=password).close()
            return
        except psycopg.OperationalError as exc:
            # libpq's text is all there is to tell a refused password from a server that is down.
            if "password authentication failed" not in str(exc):
                return
        try:
            with psycopg.connect(**login, password=PUBLISHED_PASSWORD, autocommit=True) as connection:
                connection.execute(
                    sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                        sql.Identifier(database["USER"]), sql.Literal(password)
                    )
                )
        except psycopg.OperationalError:
            return
        self.stdout.write(
            self.style.WARNING(
                f"The database still had the password {PUBLISHED_PASSWORD!r} of an old docker-compose.yml, "
                "published in RAMDeck's repository; it now has the one generated on first start."
            )
        )
