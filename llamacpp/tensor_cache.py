"""Filling a worker's RPC tensor cache from its own copy of the model, so its first load sends almost nothing.

What ggml-rpc-server keeps (ggml/src/ggml-rpc/ggml-rpc.cpp in the pinned tree): llama-server offers each
weight tensor larger than HASH_THRESHOLD (256 KiB in RAMDeck's builds, strictly larger; llamacpp/rpc_cache.py)
by an FNV-1a 64 hash of the bytes it is about to send (`fnv_hash`, offset basis 0xcbf29ce484222325, prime
0x100000001b3); a server started with `-c` that has a file named by that hash (`%016llx`: 16 lowercase
hexadecimal digits) in its cache folder loads the file instead. llama-server sends a tensor whole (one
`ggml_backend_tensor_set(cur, data, 0, n_size)`), and the bytes it sends are the file's bytes at the tensor's
offset: with mmap (the default) `data` points into the mapping, without it the tensor is read into a buffer
first; the CPU repacking (Q4_0 and others into AVX2/AMX/Arm layouts) happens only in the coordinator's own CPU
buffers, never in an RPC buffer. So a cache entry is exactly `file[data_offset + tensor.offset : ... +
n_bytes]`, named by its FNV-1a 64 hash.

The console computes each cacheable tensor's FNV-1a hash once, from its own read of the model (`fnv-c`, a C
implementation), together with the SHA-256 of the same bytes, and keeps both on the model. A worker that holds
a copy of the file then cuts those ranges out of it with FILL_SCRIPT, a POSIX sh script (GNU and BSD `tail -c`
and `head -c`, so macOS too), and checks each piece's SHA-256 on the worker before it takes its cache name: a
copy that differs from the model (edited, truncated, another quantisation under the same name) fills nothing
wrong, whatever the file is called. A split model's tensors each lie in one shard: the worker's copy has the
same shards, and the script runs once per shard, cutting from that shard's copy (`fill_argvs_shards`).

Plain Python, no Django.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import fnv_c

from llamacpp import gguf as gguf_profile
from llamacpp.rpc_cache import HASH_THRESHOLD, CacheError, check_folder

# The shape of the hashes a model keeps (ModelFile.tensor_hashes): bumped if what is hashed ever changes.
# Each entry names the shard whose file holds the tensor ("shard", 0 for a single-file model) and its offset
# in that file. Records written before split models were hashed have no "shard": they were all of
# single-file models, where shard 0 is right, so they stay valid (no model's tensors are read again) and
# `valid` refuses only such a record for a split model.
VERSION = 1
# A fill run takes at most this many tensors (4 arguments each) in its argv.
BATCH = 128

_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_BLOCK = re.compile(r"^blk\.(\d+)\.")

ReadRange = Callable[[int, int], bytes]


def fnv1a_64(data: bytes) -> str:
    """The cache file name ggml-rpc-server gives `data`: its FNV-1a 64 hash as 16 lowercase hex digits."""
    return f"{fnv_c.fnv1a_64(bytes(data)):016x}"


def cacheable(header: gguf_profile.GGUFHeader) -> list[tuple[str, int, int]]:
    """(name, offset in the file, size) of every tensor llama-server offers by hash: above HASH_THRESHOLD.
    For a split model, `header` is one shard's and the offsets are in that shard's file."""
    return [
        (t.name, header.data_offset + t.offset, t.n_bytes)
        for t in header.tensors
        if t.n_bytes > HASH_THRESHOLD
    ]


def entry(name: str, shard: int, offset: int, data: bytes) -> dict[str, Any]:
    """One tensor's record: where its bytes lie (shard index, offset in that shard's file, size) and their
    FNV-1a hash (its cache name) and SHA-256 (what the fill checks on the worker)."""
    return {
        "name": name,
        "shard": shard,
        "offset": offset,
        "size": len(data),
        "fnv": fnv1a_64(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def record(tensors: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": VERSION, "threshold": HASH_THRESHOLD, "tensors": tensors}


def hash_tensors(
    read_range: ReadRange,
    header: gguf_profile.GGUFHeader,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The hashes a single-file model keeps: {"version", "threshold", "tensors": [{"name", "shard",
    "offset", "size", "fnv", "sha256"}]}, reading each cacheable tensor once through `read_range(offset,
    size)` (whole: one tensor is in memory at a time). `progress(done_bytes, total_bytes)` after each
    tensor."""
    return hash_shards([(read_range, header)], progress=progress)


def hash_shards(
    shards: list[tuple[ReadRange, gguf_profile.GGUFHeader]],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The same for a model in several files: one (read_range, header) per shard, in order; each entry's
    "shard" is its index in `shards` and its offset is in that shard's file."""
    todo = [(index, *t) for index, (_, header) in enumerate(shards) for t in cacheable(header)]
    total = sum(size for *_, size in todo)
    done = 0
    tensors = []
    for index, name, offset, size in todo:
        data = shards[index][0](offset, size)
        if len(data) != size:
            raise gguf_profile.GGUFError(f"Tensor {name!r} is cut short: {len(data)} of {size} bytes read.")
        tensors.append(entry(name, index, offset, data))
        done += size
        if progress:
            progress(done, total)
    return record(tensors)


def valid(hashes: dict[str, Any] | None, *, shards: int = 1) -> bool:
    """Whether `hashes` can be used as they are for a model in `shards` files."""
    # Hashes taken at another threshold (upstream's 10 MiB, before builds/rpc_threshold.py) miss tensors.
    if not (
        bool(hashes)
        and hashes.get("version") == VERSION
        and hashes.get("threshold") == HASH_THRESHOLD
        and isinstance(hashes.get("tensors"), list)
    ):
        return False
    # A split model's entries must each say their shard (see VERSION).
    return shards <= 1 or all(isinstance(e, dict) and "shard" in e for e in hashes["tensors"])


def blocks_of(placement: dict[str, Any]) -> set[int]:
    """The blocks whose weights a plan's placement puts on its device: its contiguous slice, and the blocks
    whose routed experts it holds apart from it."""
    first, count = int(placement.get("first_layer") or 0), int(placement.get("layers") or 0)
    return set(range(first, first + count)) | {int(b) for b in placement.get("expert_blocks") or []}


def tensors_for(hashes: dict[str, Any], placements: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cacheable tensors a worker will be sent for `placements` (its devices' entries of a plan): those
    of its blocks, and the output layer's where it holds that (with tied embeddings, a copy of token_embd)."""
    placements = list(placements)
    blocks = set().union(*(blocks_of(p) for p in placements)) if placements else set()
    output = any(p.get("output_layer") for p in placements)
    entries = hashes.get("tensors", [])
    tied = not any(e["name"] == "output.weight" for e in entries)
    chosen = []
    for entry in entries:
        name = entry["name"]
        if match := _BLOCK.match(name):
            if int(match[1]) in blocks:
                chosen.append(entry)
        elif output and (
            name.startswith(("output.", "output_norm.")) or (tied and name == "token_embd.weight")
        ):
            chosen.append(entry)
    return chosen


def held(hashes: dict[str, Any], names: Iterable[str]) -> tuple[int, int, int]:
    """How much of a model a cache holding the files `names` has: (tensors held, of all cacheable, bytes)."""
    present = set(names)
    entries = hashes.get("tensors", []) if valid(hashes) else []
    hit = [e for e in entries if e["fnv"] in present]
    return len(hit), len(entries), sum(e["size"] for e in hit)


# $1 configured cache folder ("" for llama.cpp's default, resolved as llamacpp/rpc_cache.py does), $2 the
# worker's copy of the model, then four arguments per tensor: its cache name, offset, size and SHA-256.
# Prints "dir", then per tensor "have NAME" (a file of that name and size is there already), "filled NAME
# SIZE" or "bad NAME why" (not filled), then "free_kib". Each piece is cut into a temporary name in the
# cache folder and takes its cache name only once its size and SHA-256 are right, so rpc-server never finds a
# half-written entry under a real name.
FILL_SCRIPT = r"""
set -u
base=$1 src=$2
shift 2
if [ -z "$base" ]; then
  if [ -n "${LLAMA_CACHE:-}" ]; then base=$LLAMA_CACHE
  elif [ "$(uname -s)" = Darwin ]; then base=$HOME/Library/Caches/llama.cpp
  else base=${XDG_CACHE_HOME:-$HOME/.cache}/llama.cpp
  fi
fi
case $base in /*) ;; *) echo "error the cache folder is not an absolute path" >&2; exit 2 ;; esac
case $src in /*) ;; *) echo "error the model copy is not an absolute path" >&2; exit 2 ;; esac
[ -f "$src" ] && [ -r "$src" ] || { echo "error the model copy $src is not a readable file" >&2; exit 3; }
dir=$base/rpc
mkdir -p -- "$dir" || { echo "error cannot create $dir" >&2; exit 4; }
printf 'dir %s\n' "$dir"
if command -v sha256sum >/dev/null 2>&1; then sum() { sha256sum; }; else sum() { shasum -a 256; }; fi
size() { wc -c < "$1" | tr -d ' '; }
while [ $# -ge 4 ]; do
  name=$1 off=$2 len=$3 want=$4
  shift 4
  h=[0-9a-f]
  case $name in $h$h$h$h$h$h$h$h$h$h$h$h$h$h$h$h) ;; *) echo "bad ? not a cache name"; continue ;; esac
  case $off$len in ''|*[!0-9]*) echo "bad $name offset or size is not a number"; continue ;; esac
  f=$dir/$name
  if [ -f "$f" ] && [ ! -L "$f" ] && [ "$(size "$f")" = "$len" ]; then echo "have $name"; continue; fi
  tmp=$dir/.fill-$name.$$
  # Hashed as it is written (tee), so the piece is read once.
  have=$(tail -c +$((off + 1)) -- "$src" 2>/dev/null | head -c "$len" | tee -- "$tmp" | sum)
  have=${have%% *}
  got=$(size "$tmp")
  if [ "$got" != "$len" ]; then rm -f -- "$tmp"; echo "bad $name cut $got of $len bytes"; continue; fi
  if [ "$have" != "$want" ]; then rm -f -- "$tmp"; echo "bad $name checksum differs"; continue; fi
  mv -f -- "$tmp" "$f" && printf 'filled %s %s\n' "$name" "$len"
done
printf 'free_kib %s\n' "$(df -Pk "$dir" | awk 'NR==2 {print $4}')"
"""


def fill_argvs(folder: str, source: str, entries: list[dict[str, Any]]) -> list[list[str]]:
    """The argvs (BATCH tensors each) that fill the cache in `folder` from the worker's copy at `source`."""
    folder = check_folder(folder)
    if not source.startswith("/") or any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise CacheError("The model copy must be an absolute path of printable characters.")
    args: list[str] = []
    for entry in entries:
        name, offset, size, sha = entry["fnv"], int(entry["offset"]), int(entry["size"]), entry["sha256"]
        if not _HEX16.match(name) or not _HEX64.match(sha) or offset < 0 or size <= 0:
            raise CacheError(f"Tensor {entry.get('name')!r} has no valid hash on record.")
        args += [name, str(offset), str(size), sha]
    step = 4 * BATCH
    return [
        ["sh", "-c", FILL_SCRIPT, "ramdeck-fill", folder, source, *args[i : i + step]]
        for i in range(0, len(args), step)
    ] or [["sh", "-c", FILL_SCRIPT, "ramdeck-fill", folder, source]]


def fill_argvs_shards(folder: str, sources: list[str], entries: list[dict[str, Any]]) -> list[list[str]]:
    """The argvs that fill the cache from a worker's copy of a model in one or more files: each tensor cut
    out of the copy of its own shard (`sources[entry["shard"]]`), so the script runs once per shard that
    holds a wanted tensor (and per BATCH tensors)."""
    by_shard: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for item in entries:
        shard = item.get("shard", 0)
        if type(shard) is not int or not 0 <= shard < len(sources):
            raise CacheError(
                f"Tensor {item.get('name')!r} lies in shard {shard!r}, but the copy has "
                f"{len(sources)} file(s)."
            )
        by_shard[shard].append(item)
    return [
        argv for shard in sorted(by_shard) for argv in fill_argvs(folder, sources[shard], by_shard[shard])
    ]


def parse_fill(stdout: str) -> dict[str, Any]:
    """The fill script's output: {"dir", "have": [names], "filled": [(name, bytes)], "bad": [(name, why)],
    "free_bytes"}."""
    found: dict[str, Any] = {"dir": "", "have": [], "filled": [], "bad": [], "free_bytes": None}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "dir":
            found["dir"] = value
        elif key == "have":
            found["have"].append(value)
        elif key == "filled":
            name, _, size = value.partition(" ")
            if size.isdigit():
                found["filled"].append((name, int(size)))
        elif key == "bad":
            name, _, why = value.partition(" ")
            found["bad"].append((name, why))
        elif key == "free_kib" and value.isdigit():
            found["free_bytes"] = int(value) * 1024
    return found
