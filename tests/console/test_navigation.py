"""The top bar marks the section a page belongs to, whichever app serves the page."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def _current(client, url: str) -> list[str]:
    body = client.get(url).content.decode()
    nav = body[body.index('id="site-menu"') : body.index("</nav>")]
    return re.findall(r'aria-current="page">([^<]+)</a>', nav)


def test_each_page_marks_its_section_in_the_top_bar(admin_client):
    node = NodeFactory(name="desk")
    expected = {
        reverse("dashboard"): ["Dashboard"],
        reverse("nodes:detail", args=[node.name]): ["Nodes"],
        reverse("builds:node", args=[node.name]): ["Nodes"],
        reverse("calibration:figures", args=[node.name]): ["Nodes"],
        reverse("modelfiles:list"): ["Models"],
        reverse("deployments:list"): ["Deployments"],
        reverse("jobs:list"): ["Jobs"],
        reverse("audit"): ["Audit"],
        reverse("users:list"): ["Users"],
    }
    assert {url: _current(admin_client, url) for url in expected} == expected
