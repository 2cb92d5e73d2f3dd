"""Which commands a node gets follows what its first connection and probe found, not the operator's
platform setting (nodes/transports.py `shell_for`, Node.platform): the setting stands in only until then."""

from __future__ import annotations

import pytest

from nodes.transports import shell_for
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("hint", "found", "platform", "shell"),
    [
        ("linux", "windows", "windows", "windows"),  # set to Linux, answered in PowerShell
        ("macos", "windows", "windows", "windows"),
        ("windows", "linux", "linux", "posix"),  # set to Windows, answered by sh (WSL2 as the default shell)
        ("auto", "windows", "windows", "windows"),
        ("windows", "", "windows", ""),  # never probed: the transport tells the shells apart
        ("linux", "", "linux", ""),
    ],
)
def test_the_shell_follows_what_the_node_answered_over_its_platform_setting(hint, found, platform, shell):
    node = NodeFactory(platform_hint=hint, facts={"platform": found} if found else {})
    assert (node.platform, shell_for(node)) == (platform, shell)


def test_the_node_page_says_which_platform_the_console_uses_and_the_setting_when_they_differ(admin_client):
    node = NodeFactory(name="gaming-pc", platform_hint="linux", facts={"platform": "windows"})
    page = admin_client.get(node.get_absolute_url()).content.decode()
    line = page.split('id="platform">', 1)[1].split("</dd>", 1)[0]
    assert line == "Windows (as its SSH server answered; the setting says Linux)"
