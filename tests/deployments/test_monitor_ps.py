"""The monitor's process status from ps's POSIX `etime`, as Linux's procps and macOS's ps print it."""

from __future__ import annotations

import subprocess

from deployments.monitor import elapsed_seconds, parse_ps_status

# `ps -o pid=,etime=,rss= -p 812,913,1001` on macOS 14 (rss in KiB).
MACOS = """\
  812 02-03:04:05 1843200
  913    01:02:03  524288
 1001       00:07    2048
"""


def test_elapsed_times_in_every_posix_shape():
    assert elapsed_seconds("00:07") == 7
    assert elapsed_seconds("01:02:03") == 3723
    assert elapsed_seconds("02-03:04:05") == 2 * 86400 + 3 * 3600 + 4 * 60 + 5
    for bad in ("", "7", "a:b", "1-", "-01:02", "01:02:03:04"):
        assert elapsed_seconds(bad) is None, bad


def test_a_macs_ps_output_gives_uptime_and_memory():
    assert parse_ps_status(MACOS) == {
        812: {"uptime_s": 183845, "rss_bytes": 1843200 * 1024},
        913: {"uptime_s": 3723, "rss_bytes": 524288 * 1024},
        1001: {"uptime_s": 7, "rss_bytes": 2048 * 1024},
    }


def test_this_machines_ps_answers_the_same_command():
    text = subprocess.run(
        ["ps", "-o", "pid=,etime=,rss=", "-p", "1"], capture_output=True, text=True, timeout=30
    ).stdout
    assert set(parse_ps_status(text)) == {1}
