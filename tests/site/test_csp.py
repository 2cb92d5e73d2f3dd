"""The Content-Security-Policy the console sends, and templates that can live with it: no inline script
without the nonce, no inline event handlers, no htmx feature that needs eval."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings
from django.urls import reverse

from tests.paths import ROOT

pytestmark = [pytest.mark.security, pytest.mark.django_db]


def _templates() -> list[Path]:
    folders = [Path(d) for d in settings.TEMPLATES[0]["DIRS"]]
    folders += [ROOT / app / "templates" for app in ("audit", "jobs", "nodes", "deployments", "ramdeck_site")]
    return sorted(p for folder in folders if folder.exists() for p in folder.rglob("*.html"))


def test_pages_carry_a_nonce_policy_without_unsafe_script(admin_client):
    response = admin_client.get(reverse("dashboard"))
    policy = response.headers["Content-Security-Policy"]
    directives = dict(part.strip().split(" ", 1) for part in policy.split(";") if part.strip())
    nonce = re.search(r"'nonce-([^']+)'", directives["script-src"])[1]
    assert "unsafe-inline" not in directives["script-src"] and "unsafe-eval" not in directives["script-src"]
    assert directives["object-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
    html = response.content.decode()
    scripts = re.findall(r"<script\b[^>]*>", html)
    assert scripts
    for tag in scripts:
        assert f'nonce="{nonce}"' in tag or " src=" in tag, tag
    assert '"allowEval": false' in html  # htmx's own switch, in <meta name="htmx-config">
    # Another response, another nonce.
    again = admin_client.get(reverse("dashboard")).headers["Content-Security-Policy"]
    assert again != policy


def test_no_template_needs_inline_script_or_eval():
    found = []
    for path in _templates():
        text = path.read_text()
        name = path.relative_to(ROOT)
        for match in re.finditer(r"<script\b[^>]*>", text):
            if "src=" not in match[0] and "nonce=" not in match[0]:
                found.append(f"{name}: inline <script> without a nonce")
        if re.search(r"""hx-vals=["']\s*(js|javascript):""", text):
            found.append(f"{name}: hx-vals with js: (eval)")
        for trigger in re.findall(r'hx-trigger="([^"]*)"', text):
            # A filter is JavaScript (eval); brackets inside a `from:` CSS selector are not.
            if "[" in re.sub(r"from:\S+", "", trigger):
                found.append(f"{name}: an hx-trigger filter [...] (eval)")
        if re.search(r"\shx-on[:-]", text):
            found.append(f"{name}: hx-on (eval)")
        if re.search(r"""\son[a-z]+\s*=\s*["']""", text):
            found.append(f"{name}: an inline event handler")
        if "javascript:" in text:
            found.append(f"{name}: a javascript: URL")
    assert not found, found
