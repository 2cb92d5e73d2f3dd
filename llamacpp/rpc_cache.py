"""ggml-rpc-server's tensor cache (`rpc-server -c`) on a node: where it is, how big, and the one script that
reads, trims and clears it.

In RAMDeck's builds of llama.cpp a weight tensor larger than 256 KiB (HASH_THRESHOLD in ggml-rpc.cpp, 10 MiB
upstream: builds/rpc_threshold.py lowers it) is offered to the server by an FNV-1a hash of its bytes first; a
server started with `-c` that has a file of that name loads it from disk instead of receiving it, and saves
every such tensor it does receive. The files are named by the hash, 16 lowercase hexadecimal digits, in
`<cache folder>/rpc`, where the cache folder is `$LLAMA_CACHE`, else `~/Library/Caches/llama.cpp` on macOS,
else `${XDG_CACHE_HOME:-~/.cache}/llama.cpp`, and on Windows `%LOCALAPPDATA%\\llama.cpp`
(fs_get_cache_directory in tools/rpc/rpc-server.cpp, a copy of common/common.cpp's; the server takes its `rpc`
subfolder when started with `-c`). Nothing in llama.cpp ever removes one.

Everything runs as one script: POSIX sh on Linux and macOS (stock macOS has the same tools), taking its
inputs as positional arguments, never pasted into its text; PowerShell on Windows (`POWERSHELL_SCRIPT`),
whose inputs are single-quoted literals (remote/powershell.py `ps_quote`) or a whole number. The inputs: the
action, the node's configured cache folder (empty: llama.cpp's default, resolved on the node from the same
variables the server reads), and the size limit. Both print the same lines (`parse` reads either). Only
regular files whose name is a cache entry's are counted or removed; anything else in the folder is left
alone.
"""

from __future__ import annotations

import ntpath
import posixpath
import re

from llamacpp.args import quiet_argv
from remote.powershell import powershell_argv, ps_quote

GIB = 1024**3
# Weight tensors larger than this take the cache path: HASH_THRESHOLD in ggml-rpc.cpp as RAMDeck's builds
# set it (builds/rpc_threshold.py; upstream's 10 MiB left 4 to 22% of a model crossing the link at each load).
HASH_THRESHOLD = 256 * 1024
# A sensible default limit: the weights of a worker's share of a large model, a few times over.
DEFAULT_LIMIT_GIB = 32
ACTIONS = ("usage", "trim", "clear")

_HEX = "[0-9a-f]" * 16
_NAME = re.compile(r"^[0-9a-f]{16}$")
# The entries' names kept on the node (what the node page matches against each model's tensors): a cache
# of real models holds a few thousand at most.
MAX_NAMES = 50_000

# $1 action, $2 configured cache folder ("" for llama.cpp's default), $3 limit in bytes (trim).
# Prints "dir", an "entry <name>" line per entry found, "removed <name> <bytes>" lines, then "entries",
# "bytes" and "free_kib" of what is left.
SCRIPT = f"""
set -u
action=$1 base=$2 limit=${{3:-0}}
if [ -z "$base" ]; then
  if [ -n "${{LLAMA_CACHE:-}}" ]; then base=$LLAMA_CACHE
  elif [ "$(uname -s)" = Darwin ]; then base=$HOME/Library/Caches/llama.cpp
  else base=${{XDG_CACHE_HOME:-$HOME/.cache}}/llama.cpp
  fi
fi
case $base in /*) ;; *) echo "error the cache folder is not an absolute path" >&2; exit 2 ;; esac
case $limit in ''|*[!0-9]*) echo "error the limit is not a whole number of bytes" >&2; exit 2 ;; esac
dir=$base/rpc
printf 'dir %s\\n' "$dir"
size() {{ wc -c < "$1" | tr -d ' '; }}
total=0 entries=0
if [ -d "$dir" ]; then
  for f in "$dir"/*; do
    case ${{f##*/}} in {_HEX}) ;; *) continue ;; esac
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    total=$((total + $(size "$f"))) entries=$((entries + 1))
    printf 'entry %s\\n' "${{f##*/}}"
  done
  if [ "$action" = clear ] || {{ [ "$action" = trim ] && [ "$total" -gt "$limit" ]; }}; then
    # Oldest first (ls -t sorts by modification time, -r reverses): a file is written once, when the server
    # first receives its tensor, so this is the order the entries came in.
    set -f
    for name in $(cd "$dir" && ls -tr); do
      case $name in {_HEX}) ;; *) continue ;; esac
      f=$dir/$name
      [ -f "$f" ] && [ ! -L "$f" ] || continue
      if [ "$action" = trim ] && [ "$total" -le "$limit" ]; then break; fi
      n=$(size "$f")
      rm -f "$f" && total=$((total - n)) entries=$((entries - 1)) && printf 'removed %s %s\\n' "$name" "$n"
    done
    set +f
  fi
fi
printf 'entries %s\\nbytes %s\\n' "$entries" "$total"
probe=$dir; [ -d "$probe" ] || probe=$base; [ -d "$probe" ] || probe=$HOME
printf 'free_kib %s\\n' "$(df -Pk "$probe" | awk 'NR==2 {{print $4}}')"
"""


# The same on Windows, in Windows PowerShell 5.1. The three inputs stand first as `$action`, `$base` and
# `$limit` (`powershell_script`). Paths are joined as strings ([IO.Path]::Combine, as llama.cpp's
# std::filesystem `/` does), so a folder on a drive that is not there reads as empty, not as an error, and a
# LLAMA_CACHE on a network share (\\server\share) is taken as the server takes it. Free disk is the Free of
# the FileSystem drive whose root is the folder's (Get-PSDrive; absent for a folder on a network share).
POWERSHELL_SCRIPT = """
if (-not $base) { $base = $env:LLAMA_CACHE }
if (-not $base -and $env:LOCALAPPDATA) { $base = [IO.Path]::Combine($env:LOCALAPPDATA, 'llama.cpp') }
if ($base -notmatch '^([A-Za-z]:[\\\\/]|\\\\\\\\)') { [Console]::Error.WriteLine('error the cache folder is not an absolute path'); exit 2 }
$dir = [IO.Path]::Combine($base, 'rpc')
'dir ' + $dir
$entries = @(Get-ChildItem -LiteralPath $dir -File -ErrorAction SilentlyContinue | Where-Object { $_.Name -cmatch '^[0-9a-f]{16}$' -and -not $_.Attributes.HasFlag([IO.FileAttributes]::ReparsePoint) } | Sort-Object LastWriteTimeUtc)
$total = [long]0
$count = 0
foreach ($f in $entries) { $total += $f.Length; $count += 1; 'entry ' + $f.Name }
if ($action -eq 'clear' -or ($action -eq 'trim' -and $total -gt $limit)) { foreach ($f in $entries) { if ($action -eq 'trim' -and $total -le $limit) { break }; Remove-Item -LiteralPath $f.FullName -Force -ErrorAction SilentlyContinue; if (-not (Test-Path -LiteralPath $f.FullName)) { $total -= $f.Length; $count -= 1; 'removed ' + $f.Name + ' ' + $f.Length } } }
'entries ' + $count
'bytes ' + $total
$root = [IO.Path]::GetPathRoot($dir)
$drive = Get-PSDrive -PSProvider FileSystem | Where-Object { $_.Root -eq $root }
if ($drive) { 'free_kib ' + [long][Math]::Floor($drive.Free / 1024) }
"""  # noqa: E501
# (Get-ChildItem lists by name; Sort-Object LastWriteTimeUtc puts the oldest first, as `ls -tr` does. A file
# that Remove-Item could not remove, one rpc-server holds open, is neither counted as removed nor freed.)


class CacheError(ValueError):
    """A cache folder or limit the script must not be given."""


_WINDOWS_FOLDER = re.compile(r"^[A-Za-z]:[\\/]")


def is_windows_folder(folder: str) -> bool:
    """A path on a drive (C:\\x): a Windows node's folder. llama.cpp's cache needs no network share."""
    return bool(_WINDOWS_FOLDER.match(folder))


def check_folder(folder: str, *, windows: bool = False) -> str:
    """A configured cache folder: empty (llama.cpp's default) or an absolute path of printable characters;
    on a Windows node (`windows`) one on a drive, C:\\x, written with backslashes."""
    if not folder:
        return ""
    if any(ord(c) < 32 or ord(c) == 127 for c in folder):
        raise CacheError("The cache folder contains a control character.")
    if windows:
        if not is_windows_folder(folder):
            raise CacheError(
                "The cache folder of a Windows node must be an absolute path on a drive (such as "
                "C:\\llama-cache)."
            )
        return ntpath.normpath(folder)
    if not folder.startswith("/"):
        raise CacheError("The cache folder must be an absolute path (starting with /).")
    return posixpath.normpath(folder)


def check_any_folder(folder: str) -> str:
    """A folder for a node whose platform the form does not know yet: POSIX (/x) or Windows (C:\\x)."""
    if is_windows_folder(folder):
        return check_folder(folder, windows=True)
    try:
        return check_folder(folder)
    except CacheError as exc:
        if not folder.startswith("/"):
            raise CacheError(
                "The cache folder must be an absolute path (starting with /, or with a drive such as C:\\ "
                "on Windows)."
            ) from exc
        raise


def _checked(action: str, limit_bytes: int) -> int:
    if action not in ACTIONS:
        raise CacheError(f"Unknown cache action {action!r}.")
    limit = int(limit_bytes)
    if limit < 0:
        raise CacheError("The cache limit cannot be negative.")
    return limit


def powershell_script(action: str, folder: str = "", limit_bytes: int = 0) -> str:
    """POWERSHELL_SCRIPT with its three inputs set first: two single-quoted (verbatim) literals and an int,
    so no folder name can become PowerShell source."""
    limit = _checked(action, limit_bytes)
    inputs = f"$action = {ps_quote(action)}\n$base = {ps_quote(check_folder(folder, windows=True))}"
    return f"{inputs}\n$limit = [long]{limit}{POWERSHELL_SCRIPT}"


def script_argv(action: str, folder: str = "", limit_bytes: int = 0, *, windows: bool = False) -> list[str]:
    """The argv that runs the cache script on a node for `action` (one of ACTIONS): SCRIPT through sh, or
    on a Windows node (`windows`) POWERSHELL_SCRIPT through powershell."""
    if windows:
        return powershell_argv(powershell_script(action, folder, limit_bytes))
    limit = _checked(action, limit_bytes)
    return ["sh", "-c", SCRIPT, "ramdeck-rpc-cache", action, check_folder(folder), str(limit)]


def server_argv(
    rpc_server_path: str, args: list[str], folder: str = "", *, windows: bool = False
) -> list[str]:
    """ggml-rpc-server with its cache on: `-c`, and LLAMA_CACHE set through `env` when the node names a
    folder of its own (the server has no option for it). On Windows there is no `env` program: the
    detached start sets the variable in the PowerShell that starts the server (remote/powershell.py
    `start_detached_script` reads the same `env NAME=value` words)."""
    argv = [rpc_server_path, *args]
    if "-c" not in argv and "--cache" not in argv:
        argv.append("-c")
    folder = check_folder(folder, windows=windows)
    return ["env", f"LLAMA_CACHE={folder}", *argv] if folder else argv


CACHE_FLAGS = ("-c", "--cache")


def start_argv(
    rpc_server_path: str, args: list[str], *, limit_gib: int, folder: str = "", windows: bool = False
):
    """rpc-server's command line for a deployment: with its cache (`server_argv`) when the node keeps one (a
    limit above 0); without `-c` otherwise, so a node whose limit is 0 keeps nothing."""
    args = [arg for arg in args if arg not in CACHE_FLAGS]
    if limit_gib:
        return server_argv(rpc_server_path, args, folder, windows=windows)
    return [rpc_server_path, *args]


def launch_argv(
    rpc_server_path: str,
    args: list[str],
    *,
    limit_gib: int,
    folder: str = "",
    platform: str = "linux",
) -> list[str]:
    """The whole command line the rpc_server step starts: `start_argv` through `env` with the quiet
    environment (llamacpp/args.py `quiet_argv`: its threads sleep while they wait). The deployment page shows
    the same (deployments/views/plan.py `command_lines`)."""
    return quiet_argv(
        start_argv(rpc_server_path, args, limit_gib=limit_gib, folder=folder, windows=platform == "windows"),
        platform,
    )


def parse(stdout: str) -> dict:
    """The script's output as {"dir", "entries", "bytes", "free_bytes", "removed": [(name, bytes)]}."""
    found: dict = {"dir": "", "entries": None, "bytes": None, "free_bytes": None, "removed": [], "names": []}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "dir":
            found["dir"] = value
        elif key == "entry" and _NAME.match(value):
            found["names"].append(value)
        elif key == "removed":
            name, _, size = value.partition(" ")
            if size.isdigit():
                found["removed"].append((name, int(size)))
        elif key in ("entries", "bytes") and value.isdigit():
            found[key] = int(value)
        elif key == "free_kib" and value.isdigit():
            found["free_bytes"] = int(value) * 1024
    gone = {name for name, _ in found["removed"]}
    found["names"] = [name for name in found["names"] if name not in gone][:MAX_NAMES]
    return found
