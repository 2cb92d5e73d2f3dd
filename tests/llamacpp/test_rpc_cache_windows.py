"""The RPC cache script of a Windows node (llamacpp/rpc_cache.py POWERSHELL_SCRIPT): its inputs reach it as
literals whatever they hold, and it prints what the POSIX script prints for the same files, so one `parse`
reads both. Run here through the lab's fake PowerShell (tests/lab/fake_powershell.py) in this process; the
Windows lab (tests/lab/test_windows_cache_lab.py) runs it through SSH."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings

from llamacpp import rpc_cache
from remote.powershell import decode_script
from tests.lab.fake_powershell import Host, Str, statements, tokenize
from tests.remote.test_powershell import HOSTILE

USER_HOME = "C:\\Users\\ramdeck"
DEFAULT_DIR = f"{USER_HOME}\\AppData\\Local\\llama.cpp\\rpc"
SIZES = [100_000, 200_000, 300_000]


def _pc(tmp_path: Path, env: dict[str, str] | None = None) -> Path:
    root = tmp_path / "windows"
    (root / "C").mkdir(parents=True)
    state = {"userprofile": USER_HOME, "path": [], "processes": {}, "cim": {}, "env": env or {}}
    (root / "state.json").write_text(json.dumps(state))
    return root


def _local(root: Path, windows_path: str) -> Path:
    drive, rest = windows_path.split(":\\", 1)
    return root / drive / Path(*[p for p in rest.split("\\") if p])


def _entries(folder: Path, sizes: list[int]) -> list[Path]:
    """Cache entries as rpc-server writes them, the first the oldest, and files that are none."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    paths = []
    for i, size in enumerate(sizes):
        path = folder / f"{i + 1:016x}"
        path.write_bytes(b"\1" * size)
        os.utime(path, (now - 1000 + i * 10, now - 1000 + i * 10))
        paths.append(path)
    (folder / "notes.txt").write_text("mine")
    (folder / "00000000000000AA").write_text("upper case: not llama.cpp's name")
    (folder.parent / "elsewhere").write_text("not the cache's")
    (folder / "00000000000000ff").symlink_to(folder.parent / "elsewhere")
    return paths


def _windows(root: Path, action: str, folder: str = "", limit: int = 0) -> tuple[int, str, dict]:
    host = Host(root)
    host.out = io.StringIO()
    status = host.run_script(rpc_cache.powershell_script(action, folder, limit))
    return status, host.out.getvalue(), rpc_cache.parse(host.out.getvalue())


def _posix(folder: Path, action: str, limit: int = 0) -> dict:
    argv = rpc_cache.script_argv(action, str(folder), limit)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return rpc_cache.parse(done.stdout)


def _same(found: dict) -> dict:
    return {k: v for k, v in found.items() if k not in ("dir", "free_bytes")}


ACTIONS = [("usage", 0), ("trim", 350_000), ("trim", 10**9), ("clear", 0)]


@pytest.mark.parametrize(("action", "limit"), ACTIONS)
def test_the_windows_script_prints_what_the_posix_script_prints_for_the_same_files(tmp_path, action, limit):
    root = _pc(tmp_path)
    windows_files = _entries(_local(root, DEFAULT_DIR), SIZES)
    posix_files = _entries(tmp_path / "posix" / "rpc", SIZES)
    status, _, found = _windows(root, action, "", limit)
    assert status == 0
    assert _same(found) == _same(_posix(tmp_path / "posix", action, limit))
    assert found["dir"] == DEFAULT_DIR and found["free_bytes"] > 0
    assert [p.exists() for p in windows_files] == [p.exists() for p in posix_files]
    rpc = _local(root, DEFAULT_DIR)
    assert (rpc / "notes.txt").exists() and (rpc / "00000000000000AA").exists()
    assert (rpc.parent / "elsewhere").read_text() == "not the cache's"


def test_trim_removes_the_oldest_entries_until_the_cache_is_within_its_limit(tmp_path):
    root = _pc(tmp_path)
    files = _entries(_local(root, DEFAULT_DIR), SIZES)
    _, _, found = _windows(root, "trim", "", 350_000)
    assert found["removed"] == [("0000000000000001", 100_000), ("0000000000000002", 200_000)]
    assert (found["entries"], found["bytes"], found["names"]) == (1, 300_000, ["0000000000000003"])
    assert [p.exists() for p in files] == [False, False, True]


def test_the_folder_is_llama_caches_when_set_and_the_nodes_own_over_both(tmp_path):
    root = _pc(tmp_path, env={"LLAMA_CACHE": "D:\\models\\cache"})
    (root / "D").mkdir()
    assert _windows(root, "usage")[2]["dir"] == "D:\\models\\cache\\rpc"
    assert _windows(root, "usage", "E:\\elsewhere\\")[2]["dir"] == "E:\\elsewhere\\rpc"
    # A drive the PC lacks reads as empty, with no free space to tell.
    assert _windows(root, "usage", "E:\\elsewhere")[2]["free_bytes"] is None


def test_a_relative_llama_cache_is_refused_with_the_posix_scripts_message(tmp_path):
    root = _pc(tmp_path, env={"LLAMA_CACHE": "cache"})
    status, out, _ = _windows(root, "usage")
    assert status == 2 and "entries" not in out


@given(folder=HOSTILE.filter(lambda v: "\x00" not in v and not any(ord(c) < 32 or ord(c) == 127 for c in v)))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_any_folder_reaches_the_script_as_one_literal_or_is_refused(folder):
    path = "C:\\" + folder
    try:
        argv = rpc_cache.script_argv("trim", path, 5, windows=True)
    except Exception as exc:  # too long for a Windows command line
        assert "longer than the 8191" in str(exc)
        return
    first = statements(tokenize(decode_script(argv)))[:3]
    expected = rpc_cache.check_folder(path, windows=True)
    assert first == [["$action", "=", Str("trim")], ["$base", "=", Str(expected)], ["$limit", "=", "[long]5"]]


def test_a_posix_folder_a_negative_limit_or_an_unknown_action_never_reach_a_windows_node():
    with pytest.raises(rpc_cache.CacheError, match="on a drive"):
        rpc_cache.script_argv("usage", "/srv/llama", windows=True)
    with pytest.raises(rpc_cache.CacheError, match="negative"):
        rpc_cache.script_argv("trim", "", -1, windows=True)
    with pytest.raises(rpc_cache.CacheError, match="Unknown"):
        rpc_cache.script_argv("rm", "", windows=True)
    assert rpc_cache.check_folder("c:/llama//cache/", windows=True) == "c:\\llama\\cache"
