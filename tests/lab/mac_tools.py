"""A lab host that has only the tools a stock Mac has: `mac_like(lab, host)`.

Its sshd gives every session a PATH of one folder holding symlinks to the POSIX and BSD-style tools macOS
ships (sh, ps, kill, lsof, nohup, perl, awk, tail, ...); GNU-only ones (`timeout`, `stdbuf`, `setsid`,
`ss`, `nproc`, `flock`, `sed`, `readlink`) are absent, so a command the console sends that needs one fails
there with "not found" as it would on a Mac. The tools only macOS has answer with the recorded output of a
real Mac (tests/data/probe/, the probe's own sections): `uname` says Darwin, and `sw_vers`, `sysctl`,
`vm_stat` and `system_profiler` print what an M1 Mac mini printed, so the probe takes its macOS branch.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.paths import DATA

# What a stock macOS has (in /bin, /usr/bin, /usr/sbin) and the console may use; every one of them exists
# on macOS with the options the console passes.
MAC_TOOLS = [
    "sh", "cat", "ps", "kill", "sleep", "tail", "head", "mkdir", "rm", "mv", "cp", "ln", "ls", "chmod",
    "printenv", "env", "test", "[", "true", "false", "lsof", "nohup", "perl", "grep", "awk", "wc", "id",
    "dirname", "basename", "tar", "getconf", "tr", "cut", "sort", "uniq", "date", "mktemp", "touch", "tee",
    "xargs", "find", "expr", "hostname", "ssh", "ssh-keygen", "git", "which", "sync",
]  # fmt: skip
# GNU-only: a command that needs one of these must fail on this host.
HIDDEN = ["timeout", "stdbuf", "setsid", "ss", "nproc", "flock", "sed", "readlink"]
RECORDED = DATA / "probe" / "macos_m1_16gb.txt"


def _sections(text: str) -> dict[str, str]:
    pattern = re.compile(r"@@@ (?P<name>\S+)\n(?P<body>.*?)(?=\n@@@ |\Z)", re.S)
    return {m["name"]: m["body"].strip("\n") for m in pattern.finditer(text)}


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _printing(path: Path, text: str) -> None:
    delimiter = "RAMDECK_RECORDED_END"
    assert delimiter not in text
    _script(path, f"cat <<'{delimiter}'\n{text}\n{delimiter}\n")


def mac_path(folder: Path) -> Path:
    """The Mac-like bin folder under `folder`."""
    bin_dir = folder / "mac-bin"
    bin_dir.mkdir()
    for tool in MAC_TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is missing on this machine"
        (bin_dir / tool).symlink_to(found)
    recorded = _sections(RECORDED.read_text())
    system, release, machine = recorded["uname"].split()
    # `uname` with the flags the console uses: -s, -m, -snrm.
    _script(
        bin_dir / "uname",
        'case "${1:--s}" in\n'
        f"  -s) echo {system} ;;\n  -m) echo {machine} ;;\n  -r) echo {release} ;;\n"
        f"  -n) echo {recorded['hostname']} ;;\n"
        f"  -snrm) echo {system} {recorded['hostname']} {release} {machine} ;;\n"
        '  *) echo "uname: unsupported flag $1" >&2; exit 1 ;;\nesac\n',
    )
    _printing(bin_dir / "sw_vers", recorded["sw_vers"])
    _printing(bin_dir / "sysctl", recorded["sysctl"])
    _printing(bin_dir / "vm_stat", recorded["vm_stat"])
    _printing(bin_dir / "system_profiler", recorded["displays"])
    for tool in HIDDEN:
        assert not (bin_dir / tool).exists()
    return bin_dir


def mac_like(lab, host) -> Path:
    """Restart `host`'s sshd so that every session's PATH is the Mac-like folder; returns the folder."""
    bin_dir = mac_path(host.workdir)
    lab.start_sshd(host, extra_config=[f"SetEnv PATH={bin_dir}"])
    return bin_dir
