"""The child process of llamacpp/gguf_isolated.py: parses GGUF headers under a memory limit.

Run as `python -m llamacpp.gguf_child BUDGET_BYTES`. It reads requests on stdin (one JSON line each, a
header request followed by its raw bytes) and answers each with one JSON line on stdout; a GGUFError becomes
{"error": class name, "message": ...}. It imports no Django and reads no setting.

Only `gguf.constants` of the `gguf` package is needed; importing the package itself pulls in numpy and its
writer (0.3 s and 20 MB more per child), so the package is entered without running its `__init__`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types


def _enter_gguf_without_its_init() -> None:
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations or "gguf" in sys.modules:
        return
    package = types.ModuleType("gguf")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["gguf"] = package
    try:
        import gguf.constants  # noqa: F401 - only a check that the constants stand alone
    except ImportError:
        # A gguf whose constants need the package: import it the ordinary way.
        for name in [n for n in sys.modules if n == "gguf" or n.startswith("gguf.")]:
            del sys.modules[name]


_enter_gguf_without_its_init()

from llamacpp import gguf as gguf_profile  # noqa: E402 - after the gguf package is entered


def _limit_memory(budget: int) -> None:
    """RLIMIT_AS = what is mapped now (the interpreter, the parser) + `budget`. Linux only: elsewhere the
    parser's own limits are the bound."""
    try:
        import resource

        with open("/proc/self/status") as status:
            mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + budget, mapped + budget))
    except (ImportError, OSError, StopIteration, ValueError):
        return


def _answer(request: dict, payload: bytes, headers: list[gguf_profile.GGUFHeader]) -> dict:
    op = request.get("op")
    if op == "path":
        return {"profile": gguf_profile.profile_path(request["path"])}
    if op == "header":
        index, count = int(request["index"]), int(request["count"])
        if index != len(headers):
            raise RuntimeError(f"shard {index} asked for after {len(headers)} headers")
        header = gguf_profile.parse_header_bytes(payload, file_size=int(request["file_size"]))
        split = gguf_profile.split_count(header)
        if index:
            gguf_profile.check_shard(header, index, count, request["path"])
        headers.append(header)
        return {"split_count": split, "data_offset": header.data_offset, "tensor_count": len(header.tensors)}
    if op == "profile":
        return {"profile": gguf_profile.build_profile(headers, shard_names=list(request["shard_names"]))}
    raise RuntimeError(f"unknown request {op!r}")


def serve(budget: int) -> None:
    _limit_memory(budget)
    stdin, stdout = sys.stdin.buffer, sys.stdout
    headers: list[gguf_profile.GGUFHeader] = []
    while line := stdin.readline():
        request, payload, stop = json.loads(line), b"", False
        try:
            payload = stdin.read(int(request.get("length") or 0))
            answer = _answer(request, payload, headers)
        except MemoryError:
            # Free what the parse built so the answer can be written, then stop: what is left of the
            # request may still be in the pipe.
            payload, headers, stop = b"", [], True
            answer = {
                "error": "OutOfRange",
                "message": f"Reading the GGUF header needed more than {budget >> 20} MiB of memory and was "
                "stopped: the file is corrupt or not a model.",
            }
        except gguf_profile.GGUFError as exc:
            answer = {"error": type(exc).__name__, "message": str(exc), "needed": getattr(exc, "needed", 0)}
        except Exception as exc:
            answer = {"error": "GGUFError", "message": f"The GGUF header could not be read ({exc!r:.300})."}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()
        if stop:
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]))
