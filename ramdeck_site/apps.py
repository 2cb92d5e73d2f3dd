from django.apps import AppConfig


class RamdeckSiteConfig(AppConfig):
    """The project package as an app: roles migration, site-wide commands and views."""

    name = "ramdeck_site"
    verbose_name = "RAMDeck"
