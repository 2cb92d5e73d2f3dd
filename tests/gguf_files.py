"""GGUF headers written by hand, as an attacker would: the pieces, and the 182-byte file that claims 4,000,000
blocks."""

from __future__ import annotations

import struct

from gguf.constants import GGUF_MAGIC
from gguf.constants import GGUFValueType as T


def gguf_str(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def gguf_kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gguf_str(key) + struct.pack("<I", vtype) + payload


def gguf_u32(key: str, value: int) -> bytes:
    return gguf_kv(key, T.UINT32, struct.pack("<I", value))


def gguf_array(key: str, item_type: int, count: int, items: bytes = b"") -> bytes:
    return gguf_kv(key, T.ARRAY, struct.pack("<IQ", item_type, count) + items)


def llama_kvs(blocks: int = 2) -> list[bytes]:
    return [
        gguf_kv("general.architecture", T.STRING, gguf_str("llama")),
        gguf_u32("llama.block_count", blocks),
        gguf_u32("llama.embedding_length", 4096),
        gguf_u32("llama.attention.head_count", 32),
    ]


def gguf_file(kvs: list[bytes], tensors: list[bytes] = (), *, n_kv=None, n_tensors=None) -> bytes:
    head = struct.pack(
        "<IIQQ",
        GGUF_MAGIC,
        3,
        len(tensors) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    return head + b"".join(kvs) + b"".join(tensors)


def gguf_tensor(name: str, shape: tuple[int, ...], offset: int = 0, ggml_type: int = 0) -> bytes:
    dims = struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
    return gguf_str(name) + dims + struct.pack("<IQ", ggml_type, offset)


HOSTILE_BLOCKS = gguf_file(llama_kvs(blocks=4_000_000))


BLOCKS_MESSAGE = "llama.block_count is 4000000; a GGUF model has at most 4096 blocks."
