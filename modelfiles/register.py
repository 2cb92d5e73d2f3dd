"""Reading a model's header on its node: only the GGUF header bytes cross the network, and they are parsed
in a bounded child process (llamacpp/gguf_isolated.py)."""

from __future__ import annotations

import posixpath
from typing import Any

from llamacpp import gguf as gguf_profile
from llamacpp import gguf_isolated

# The first read of a header; it grows (×4) only for headers larger than that (big vocabularies), up to
# the largest header the parser accepts.
HEAD_FIRST_READ = 256 * 1024


HEAD_MAX_READ = gguf_profile.MAX_HEADER_BYTES


# Bounds the whole profile read of a job (the register view has its own, shorter bound).
PROFILE_TIMEOUT_S = 300.0


# One line per path: its size in bytes, or "missing", "other" (not a regular file), "unreadable".
# Constant text; the paths arrive as positional arguments. `wc -c <` on a regular file asks the file
# system for the size (GNU and BSD), it does not read the file.
_SIZES_SCRIPT = (
    'for f in "$@"; do '
    'if [ -f "$f" ]; then s=$(wc -c < "$f" 2>/dev/null) && echo $s || echo unreadable; '
    'elif [ -e "$f" ]; then echo other; else echo missing; fi; done'
)


async def file_sizes(transport, paths: list[str]) -> list[int | str]:
    """For each path: its size, or "missing", "other" (not a regular file) or "unreadable"."""
    if not paths:
        return []
    result = await transport.run(["sh", "-c", _SIZES_SCRIPT, "sh", *paths], timeout=60)
    answers = result.stdout.split()
    if not result.ok or len(answers) != len(paths):
        raise gguf_profile.GGUFError(
            f"Could not look up the files on the node (exit status {result.exit_status})."
        )
    return [int(a) if a.isdigit() else a for a in answers]


def _refuse(path: str, state: int | str) -> None:
    if state == "missing":
        raise gguf_profile.GGUFError(f"No such file: {path}")
    if state == "other":
        raise gguf_profile.GGUFError(f"{path} is not a regular file (a directory?).")
    if state == "unreadable":
        raise gguf_profile.GGUFError(f"{path} cannot be read by the console's user on the node.")


async def read_header(
    transport,
    path: str,
    reader: gguf_isolated.HeaderReader,
    *,
    file_size: int,
    index: int = 0,
    count: int = 1,
) -> dict[str, int]:
    """Hand shard `index`'s GGUF header to `reader` (the bounded child process that parses it) from the first
    bytes of the file; reads more only when the header needs it. Answers the reader's summary
    ({"split_count", "data_offset", "tensor_count"})."""
    size = HEAD_FIRST_READ
    while True:
        data = await transport.read_head(path, size)
        try:
            return await reader.add_header(data, file_size=file_size, index=index, count=count, path=path)
        except gguf_profile.TruncatedHeader as exc:
            if len(data) < size or exc.needed > file_size:
                raise  # The file itself ends inside its header.
            if size >= HEAD_MAX_READ:
                raise gguf_profile.OutOfRange(
                    f"The GGUF header of {path} is larger than {HEAD_MAX_READ // 2**20} MiB; "
                    "the header is corrupt or the file is not a model."
                ) from None
            size = min(max(size * 4, exc.needed), HEAD_MAX_READ)


async def read_model_profile(transport, path: str) -> dict[str, Any]:
    """The planner's profile of a GGUF model on the node behind `transport` (an open one).

    For a split model `path` is the first shard and the others are looked for beside it. The headers are
    parsed in a child process with a memory and a time limit (llamacpp/gguf_isolated.py); only their
    bytes pass through here. Raises a `gguf_profile.GGUFError` subclass whose message names the problem.
    """
    [first_state] = await file_sizes(transport, [path])
    _refuse(path, first_state)
    async with gguf_isolated.HeaderReader() as reader:
        first = await read_header(transport, path, reader, file_size=first_state)
        count = first["split_count"]
        paths = gguf_profile.shard_paths(path, count)
        states = [first_state, *await file_sizes(transport, paths[1:])]
        missing = [
            posixpath.basename(p) for p, state in zip(paths, states, strict=True) if state == "missing"
        ]
        if missing:
            raise gguf_profile.MissingShard(
                f"{posixpath.basename(path)} is shard 1 of {count}, but {len(missing)} shard"
                f"{'s are' if len(missing) > 1 else ' is'} missing beside it: {', '.join(missing)}"
            )
        for index, (shard, state) in enumerate(zip(paths[1:], states[1:], strict=True), start=1):
            try:
                _refuse(shard, state)
                await read_header(transport, shard, reader, file_size=state, index=index, count=count)
            except gguf_profile.MissingShard:
                raise  # It says which shard it is and which it should be.
            except gguf_profile.GGUFError as exc:
                # Same kind of error, but saying which shard: the operator registered the first one.
                which = f"Shard {index + 1} of {count} ({posixpath.basename(shard)})"
                raise type(exc)(f"{which}: {exc}") from None
        profile = await reader.profile([posixpath.basename(p) for p in paths])
    profile["shard_paths"] = paths
    profile["size_bytes"] = sum(states)
    return profile


def mib(size: int) -> str:
    """MiB with one decimal, cut rather than rounded: the same figure the shell's progress lines show."""
    return f"{size // 2**20}.{size % 2**20 * 10 // 2**20}"
