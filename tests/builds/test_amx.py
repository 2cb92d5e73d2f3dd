"""builds/amx.py: a CPU that lists AMX but faults on it gets a build without AMX (the check run for real,
with a stand-in compiler whose programs end as a working, a refusing and a faulting CPU's would)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from builds.amx import NO_AMX_FLAGS, amx_check_argv, amx_flags, amx_verdict


def _check(tmp_path, cpu_flags: str, program_body: str | None) -> str:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx512f {cpu_flags}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cc = bin_dir / "cc"
    if program_body is None:
        cc.write_text("#!/bin/sh\necho 'cc: error: unrecognized option -mamx-tile' >&2\nexit 1\n")
    else:
        # "Compiles" the check into a program that ends the way the CPU would make it end.
        cc.write_text(
            '#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n'
            f"printf '#!/bin/sh\\n%s\\n' '{program_body}' > \"$2\"\nchmod +x \"$2\"\n"
        )
    cc.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CC": str(cc)}
    result = subprocess.run(amx_check_argv(str(cpuinfo)), capture_output=True, text=True, env=env, timeout=60)
    assert result.stderr == "", result.stderr  # not even the shell's "Illegal instruction"
    return amx_verdict(result.stdout)


@pytest.mark.parametrize(
    ("cpu_flags", "program", "verdict"),
    [
        ("avx512vnni", "exit 0", "absent"),  # no amx_tile listed: nothing to check
        ("amx_tile amx_int8", "exit 0", "works"),
        ("amx_tile amx_int8", "exit 2", "refused"),  # Linux refused the tile data: llama.cpp turns AMX off
        ("amx_tile amx_int8", "kill -ILL $$", "faults"),  # SIGILL at tilezero, as in a Firecracker VM
        ("amx_tile amx_int8", "kill -SEGV $$", "faults"),  # SIGSEGV at ldtilecfg
        ("amx_tile amx_int8", None, "untested"),  # a compiler without -mamx-tile
    ],
)
def test_the_check_tells_a_working_amx_from_one_that_faults(tmp_path, cpu_flags, program, verdict):
    assert _check(tmp_path, cpu_flags, program) == verdict


def test_only_a_faulting_amx_changes_the_build_flags():
    assert amx_flags("faults") == NO_AMX_FLAGS
    for verdict in ("absent", "works", "refused", "untested"):
        assert amx_flags(verdict) == []
    # -mno-<feature> outranks -march=native in GCC and Clang whatever the order: both languages get it.
    assert NO_AMX_FLAGS == [
        "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
        "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    ]
    assert amx_verdict("garbage\n") == "untested"


def test_the_check_program_compiles_and_runs_on_this_machine(tmp_path):
    """The real program through the real compiler: on this machine's CPU it gives a definite verdict."""
    result = subprocess.run(amx_check_argv(), capture_output=True, text=True, timeout=120)
    verdict = amx_verdict(result.stdout)
    listed = "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    assert verdict != "untested", result
    assert (verdict == "absent") == (not listed)
