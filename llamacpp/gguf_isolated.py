"""GGUF headers parsed in a child process with a memory limit and a time limit.

A GGUF header is input from whoever put the file on a node, and the console parses it where a stall or a
crash costs everyone: on daphne's event loop (the register view) or in a Celery worker (the download job).
The parser itself is bounded (llamacpp/gguf.py: every count capped, long arrays stepped over, the
header at most 64 MiB), and on top of that the pages and jobs parse in a child process
(`python -m llamacpp.gguf_child`):

- memory: the child limits its own address space (RLIMIT_AS) to what it has mapped after its imports plus
  `MEMORY_BUDGET_BYTES`; past it an allocation fails inside the child, never in the console;
- time: each request gets `REQUEST_TIMEOUT_S`, after which the child is killed;
- the event loop only waits on a pipe, and gets back a few small answers and the finished profile (lists of
  at most MAX_BLOCKS numbers), never the header's objects.

One child serves one model's reading (`HeaderReader`, an async context manager): the first shard's header,
the other shards', then the profile of them all. Requests are one JSON line each (a header request is
followed by its raw bytes); answers are one JSON line each. Starting the child and parsing a small model took
0.12 to 0.26 s here (the interpreter and `gguf.constants` only: numpy is not imported in the child).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from llamacpp import gguf as gguf_profile
from remote.local import scrubbed_env

# Added to what the child has mapped after its imports (about 18 MiB). A 60 MiB header at every limit at
# once (65,536 tensors, 4,096 blocks, 262,144 kept values, 1.9 million strings) peaked 104 MiB above that.
MEMORY_BUDGET_BYTES = 256 * 2**20
REQUEST_TIMEOUT_S = 30.0
# The longest answer line accepted (a profile is a few KB; this only guards the pipe).
ANSWER_MAX_BYTES = 16 * 2**20

_ROOT = Path(__file__).resolve().parent.parent
_ERRORS: dict[str, type[gguf_profile.GGUFError]] = {
    cls.__name__: cls
    for cls in (
        gguf_profile.GGUFError,
        gguf_profile.NotGGUF,
        gguf_profile.TruncatedHeader,
        gguf_profile.UnsupportedVersion,
        gguf_profile.MissingShard,
        gguf_profile.OutOfRange,
    )
}


class HeaderReader:
    """A child process that parses the headers of one model and builds its profile."""

    def __init__(self, *, timeout: float = REQUEST_TIMEOUT_S, memory_bytes: int = MEMORY_BUDGET_BYTES):
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> HeaderReader:
        # The child needs no secret of the console's; should it have to import the whole `gguf` package
        # (llamacpp/gguf_child.py), numpy gets one BLAS thread rather than one per core.
        env = scrubbed_env({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        # The project's packages, whatever the console's working directory or PYTHONSAFEPATH say.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH", "")]))
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llamacpp.gguf_child",
            str(self.memory_bytes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            cwd=_ROOT,
            env=env,
            limit=ANSWER_MAX_BYTES,
        )
        return self

    async def __aexit__(self, *exc) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(OSError, RuntimeError):
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 2.0)
        except TimeoutError:
            pass
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def _ask(self, request: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
        process = self._process
        if process is None:
            raise RuntimeError("HeaderReader is used outside its `async with`.")
        try:
            async with asyncio.timeout(self.timeout):
                try:
                    process.stdin.write(json.dumps({**request, "length": len(payload)}).encode() + b"\n")
                    process.stdin.write(payload)
                    await process.stdin.drain()
                except ConnectionError:
                    pass  # The child stopped reading (out of memory): its answer says why.
                line = await process.stdout.readline()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            raise gguf_profile.GGUFError(
                f"Reading the GGUF header took longer than {self.timeout:g} s and was stopped: the file is "
                "corrupt or not a model."
            ) from None
        except (ConnectionError, ValueError):  # The child is gone, or its answer overran the pipe limit.
            line = b""
        if not line.endswith(b"\n"):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            status = await process.wait()
            raise gguf_profile.GGUFError(f"The GGUF header reader stopped (exit status {status}).")
        try:
            answer = json.loads(line)
        except ValueError:
            raise gguf_profile.GGUFError("The GGUF header reader gave an answer that is not JSON.") from None
        if "error" in answer:
            cls = _ERRORS.get(answer["error"], gguf_profile.GGUFError)
            if cls is gguf_profile.TruncatedHeader:
                raise cls(answer["message"], needed=int(answer.get("needed") or 0))
            raise cls(answer["message"])
        return answer

    async def add_header(
        self, data: bytes, *, file_size: int, index: int = 0, count: int = 1, path: str = ""
    ) -> dict[str, int]:
        """Parse the first bytes of shard `index` (of `count`; `file_size` is the whole file's) and keep it
        for `profile`. Answers {"split_count", "data_offset", "tensor_count"}; raises `TruncatedHeader`
        (with `.needed`) when `data` is too short, and the other GGUFErrors as the in-process parser does."""
        request = {"op": "header", "file_size": file_size, "index": index, "count": count, "path": path}
        return await self._ask(request, data)

    async def profile(self, shard_names: list[str]) -> dict[str, Any]:
        """The profile of the headers added so far (first shard first)."""
        return (await self._ask({"op": "profile", "shard_names": shard_names}))["profile"]

    async def profile_of_path(self, path: str) -> dict[str, Any]:
        """`gguf_profile.profile_path` in the child: a model on the console's own host, its shards found
        beside it."""
        return (await self._ask({"op": "path", "path": path}))["profile"]


async def profile_of_path(path: str) -> dict[str, Any]:
    """The profile of a GGUF model on the console's own host, parsed in a bounded child process."""
    async with HeaderReader() as reader:
        return await reader.profile_of_path(path)
