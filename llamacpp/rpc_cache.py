"""ggml-rpc-server's tensor cache (`rpc-server -c`) on a node: where it is, how big, and the one script that
reads, trims and clears it.

In RAMDeck's builds of llama.cpp a weight tensor larger than 256 KiB (HASH_THRESHOLD in ggml-rpc.cpp, 10 MiB
upstream: builds/rpc_threshold.py lowers it) is offered to the server by an FNV-1a hash of its bytes first; a
server started with `-c` that has a file of that name loads it from disk instead of receiving it, and saves
every such tensor it does receive. The files are named by the hash, 16 lowercase hexadecimal digits, in
`<cache folder>/rpc`, where the cache folder is `$LLAMA_CACHE`, else `~/Library/Caches/llama.cpp` on macOS,
else `${XDG_CACHE_HOME:-~/.cache}/llama.cpp` (fs_get_cache_directory in tools/rpc/rpc-server.cpp). Nothing in
llama.cpp ever removes one.

Everything runs as one POSIX sh script (stock macOS has the same tools) taking its inputs as positional
arguments, never pasted into its text: the action, the node's configured cache folder (empty: llama.cpp's
default, resolved on the node from the same variables the server reads), and the size limit. Only regular
files whose name is a cache entry's are counted or removed; anything else in the folder is left alone.
"""

from __future__ import annotations

import posixpath
import re

from llamacpp.args import quiet_argv

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


class CacheError(ValueError):
    """A cache folder or limit the script must not be given."""


def check_folder(folder: str) -> str:
    """A configured cache folder: empty (llama.cpp's default) or an absolute path of printable characters."""
    if not folder:
        return ""
    if not folder.startswith("/"):
        raise CacheError("The cache folder must be an absolute path (starting with /).")
    if any(ord(c) < 32 or ord(c) == 127 for c in folder):
        raise CacheError("The cache folder contains a control character.")
    return posixpath.normpath(folder)


def script_argv(action: str, folder: str = "", limit_bytes: int = 0) -> list[str]:
    """The argv that runs SCRIPT on a node for `action` (one of ACTIONS)."""
    if action not in ACTIONS:
        raise CacheError(f"Unknown cache action {action!r}.")
    limit = int(limit_bytes)
    if limit < 0:
        raise CacheError("The cache limit cannot be negative.")
    return ["sh", "-c", SCRIPT, "ramdeck-rpc-cache", action, check_folder(folder), str(limit)]


def server_argv(rpc_server_path: str, args: list[str], folder: str = "") -> list[str]:
    """ggml-rpc-server with its cache on: `-c`, and LLAMA_CACHE set through `env` when the node names a
    folder of its own (the server has no option for it)."""
    argv = [rpc_server_path, *args]
    if "-c" not in argv and "--cache" not in argv:
        argv.append("-c")
    folder = check_folder(folder)
    return ["env", f"LLAMA_CACHE={folder}", *argv] if folder else argv


CACHE_FLAGS = ("-c", "--cache")


def start_argv(
    rpc_server_path: str, args: list[str], *, limit_gib: int, folder: str = "", posix: bool = True
):
    """rpc-server's command line for a deployment: with its cache (`server_argv`) when the node keeps one (a
    limit above 0, on a POSIX node, whose cache the console can trim); without `-c` otherwise, so a node whose
    limit is 0, or one whose cache nobody could trim or clear, keeps nothing."""
    args = [arg for arg in args if arg not in CACHE_FLAGS]
    if limit_gib and posix:
        return server_argv(rpc_server_path, args, folder)
    return [rpc_server_path, *args]


def launch_argv(
    rpc_server_path: str,
    args: list[str],
    *,
    limit_gib: int,
    folder: str = "",
    posix: bool = True,
    platform: str = "linux",
) -> list[str]:
    """The whole command line the rpc_server step starts: `start_argv` through `env` with the quiet
    environment (llamacpp/args.py `quiet_argv`: its threads sleep while they wait). The deployment page shows
    the same (deployments/views/plan.py `command_lines`)."""
    return quiet_argv(
        start_argv(rpc_server_path, args, limit_gib=limit_gib, folder=folder, posix=posix), platform
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
