"""Read a GGUF file's header and turn it into the planner's memory profile.

Only the header is read: the key/value section and the tensor-info section, never the weights. The parser
takes a `read_range(offset, size) -> bytes` callable so the same code works on a local file, on an SFTP
handle, or on the first bytes of a file already fetched (`parse_header_bytes`). The `gguf` package supplies
the constants (value types, quantisation block sizes); its `GGUFReader` is not used because it memory-maps a
whole local path.

The profile (a JSON-able dict, stored on `ModelFile.profile`) is what `deployments/planner.py` consumes.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, LlamaFileType

ReadRange = Callable[[int, int], bytes]

SUPPORTED_VERSIONS = (2, 3)
# Sanity limits so a corrupt header cannot make us allocate gigabytes.
_MAX_COUNT = 10_000_000
_MAX_STRING = 64 * 1024 * 1024
_MAX_DIMS = 8
# Arrays longer than this (token lists, merges) are summarised by their length in the profile fields.
_KEEP_ARRAY = 4096

_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SHARD_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """The file cannot be used as a model. The message is for people."""


class NotGGUF(GGUFError):
    pass


class TruncatedHeader(GGUFError):
    """The header ends before it should: the file is cut short, or not enough bytes were supplied."""

    def __init__(self, message: str, *, needed: int = 0):
        super().__init__(message)
        self.needed = needed


class UnsupportedVersion(GGUFError):
    pass


class MissingShard(GGUFError):
    pass


@dataclass
class TensorInfo:
    name: str
    shape: list[int]
    ggml_type: int
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def n_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return self.n_elements // block_size * type_size


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)
    # Where the tensor data begins (header end rounded up to general.alignment).
    data_offset: int = 0


class _Cursor:
    """Sequential little-endian reads through `read_range`, fetched in growing chunks."""

    def __init__(self, read_range: ReadRange, chunk: int = 1 << 20):
        self._read = read_range
        self._buf = b""
        self._buf_start = 0
        self._chunk = chunk
        self.pos = 0

    def take(self, size: int) -> bytes:
        end = self.pos + size
        if end > self._buf_start + len(self._buf):
            want = max(end - self.pos, self._chunk)
            data = self._read(self.pos, want)
            if len(data) < end - self.pos:
                raise TruncatedHeader(
                    f"The GGUF header is cut short at byte {self.pos + len(data)} (needed {end}).", needed=end
                )
            self._buf, self._buf_start = data, self.pos
            self._chunk = min(self._chunk * 2, 64 << 20)
        start = self.pos - self._buf_start
        self.pos = end
        return self._buf[start : start + size]

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = _SCALAR[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        length = self.u64()
        if length > _MAX_STRING:
            raise GGUFError(f"Implausible string length {length} at byte {self.pos}: the header is corrupt.")
        return self.take(length).decode("utf-8", errors="replace")


def _value(cur: _Cursor, vtype: int) -> Any:
    try:
        vtype = GGUFValueType(vtype)
    except ValueError:
        raise GGUFError(
            f"Unknown GGUF value type {vtype} at byte {cur.pos}: the header is corrupt."
        ) from None
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        item_type = cur.u32()
        count = cur.u64()
        if count > _MAX_COUNT:
            raise GGUFError(f"Implausible array length {count}: the header is corrupt.")
        items = [_value(cur, item_type) for _ in range(count)]
        return items if count <= _KEEP_ARRAY else {"array_length": count}
    return cur.scalar(vtype)


def _describe(magic: bytes) -> str:
    """The first bytes of a file in plain words: as text when they are printable, else in hex."""
    text = magic.decode("ascii", errors="replace")
    if text.isprintable() and "\ufffd" not in text:
        return f"“{text}”"
    return "the bytes " + " ".join(f"{b:02x}" for b in magic)


def parse_header(read_range: ReadRange) -> GGUFHeader:
    """Parse the key/value and tensor-info sections through `read_range(offset, size)`.

    `read_range` may return fewer bytes than asked at the end of the file; the parser raises
    `TruncatedHeader` only when it actually needs the missing bytes.
    """
    cur = _Cursor(read_range)
    try:
        magic = cur.take(4)
    except TruncatedHeader:
        raise NotGGUF("This is not a GGUF file (it is shorter than the 4-byte magic).") from None
    if struct.unpack("<I", magic)[0] != GGUF_MAGIC:
        raise NotGGUF(f"This is not a GGUF file: it begins with {_describe(magic)}, a GGUF file with GGUF.")
    version = cur.u32()
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version >> 16 in SUPPORTED_VERSIONS:
            raise UnsupportedVersion("This GGUF file is big-endian; only little-endian files are supported.")
        raise UnsupportedVersion(f"GGUF version {version} is not supported (supported: 2 and 3).")
    tensor_count, kv_count = cur.u64(), cur.u64()
    if tensor_count > _MAX_COUNT or kv_count > _MAX_COUNT:
        raise GGUFError("Implausible tensor or key count: the header is corrupt.")
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        fields[key] = _value(cur, cur.u32())
    tensors = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.u32()
        if n_dims > _MAX_DIMS:
            raise GGUFError(f"Tensor {name!r} claims {n_dims} dimensions: the header is corrupt.")
        shape = [cur.u64() for _ in range(n_dims)]
        ggml_type = cur.u32()
        if ggml_type not in GGML_QUANT_SIZES:
            raise GGUFError(f"Tensor {name!r} has unknown type {ggml_type}.")
        tensors.append(TensorInfo(name=name, shape=shape, ggml_type=ggml_type, offset=cur.u64()))
    alignment = int(fields.get("general.alignment", 32)) or 32
    data_offset = -(-cur.pos // alignment) * alignment
    return GGUFHeader(version=version, fields=fields, tensors=tensors, data_offset=data_offset)


def parse_header_bytes(data: bytes) -> GGUFHeader:
    """Parse from the first bytes of a file. Raises `TruncatedHeader` (with `.needed`) if they are too few."""

    def read_range(offset: int, size: int) -> bytes:
        return data[offset : offset + size]

    return parse_header(read_range)


def read_header_path(path: str | os.PathLike[str]) -> GGUFHeader:
    try:
        with open(path, "rb") as fh:

            def read_range(offset: int, size: int) -> bytes:
                fh.seek(offset)
                return fh.read(size)

            return parse_header(read_range)
    except FileNotFoundError:
        raise GGUFError(f"No such file: {path}") from None
    except IsADirectoryError:
        raise GGUFError(f"{path} is a directory, not a GGUF file.") from None


def shard_paths(first_path: str, split_count: int) -> list[str]:
    """Paths of every shard of a split model, from the first one (`name-00001-of-0000N.gguf`)."""
    if split_count <= 1:
        return [first_path]
    directory, base = os.path.split(first_path)
    match = _SHARD_RE.match(base)
    if not match or int(match["no"]) != 1 or int(match["count"]) != split_count:
        raise MissingShard(
            f"{base} says the model has {split_count} shards, but its name is not the first of "
            f"'NAME-00001-of-{split_count:05d}.gguf'; register the first shard."
        )
    return [
        os.path.join(directory, f"{match['prefix']}-{i:05d}-of-{split_count:05d}.gguf")
        for i in range(1, split_count + 1)
    ]


def _arch_field(fields: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    return fields.get(f"{arch}.{key}", default)


def _per_layer(value: Any, n_layer: int, name: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise GGUFError(f"{name} has {len(value)} entries for {n_layer} blocks.")
        return [int(v) for v in value]
    return [int(value)] * n_layer


def _swa_layers(fields: dict[str, Any], arch: str, n_layer: int) -> list[bool]:
    """Which layers use the sliding window. Without a pattern we assume none (a safe over-estimate of KV)."""
    if not _arch_field(fields, arch, "attention.sliding_window"):
        return [False] * n_layer
    pattern = _arch_field(fields, arch, "attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == n_layer:
        return [bool(v) for v in pattern]
    if isinstance(pattern, int) and pattern > 1:
        # llama.cpp's set_swa_pattern(n): every n-th layer is dense, the others slide.
        return [il % pattern < pattern - 1 for il in range(n_layer)]
    return [False] * n_layer


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def build_profile(headers: list[GGUFHeader], *, shard_names: list[str] | None = None) -> dict[str, Any]:
    """The planner's memory profile from the headers of every shard (first shard first)."""
    fields = headers[0].fields
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("The file has no general.architecture: it is not a model.")
    n_layer = _arch_field(fields, arch, "block_count")
    n_embd = _arch_field(fields, arch, "embedding_length")
    n_head_field = _arch_field(fields, arch, "attention.head_count")
    if not n_layer or not n_embd or n_head_field is None:
        raise GGUFError(f"{arch}: block_count, embedding_length or attention.head_count is missing.")
    n_layer, n_embd = int(n_layer), int(n_embd)
    n_head = _per_layer(n_head_field, n_layer, "attention.head_count")
    n_head_kv = _per_layer(
        _arch_field(fields, arch, "attention.head_count_kv", n_head), n_layer, "head_count_kv"
    )
    head_dim = n_embd // max(n_head) if max(n_head) else 0
    key_length = _per_layer(
        _arch_field(fields, arch, "attention.key_length", head_dim), n_layer, "key_length"
    )
    value_length = _per_layer(
        _arch_field(fields, arch, "attention.value_length", head_dim), n_layer, "value_length"
    )

    block_bytes = [0] * n_layer
    output_bytes = input_bytes = other_bytes = 0
    has_output = False
    embd_bytes = 0
    total = 0
    for header in headers:
        for tensor in header.tensors:
            size = tensor.n_bytes
            total += size
            match = _BLOCK_RE.match(tensor.name)
            if match and int(match[1]) < n_layer:
                block_bytes[int(match[1])] += size
            elif tensor.name == "output.weight":
                output_bytes += size
                has_output = True
            elif tensor.name.startswith("output_norm."):
                output_bytes += size
            elif tensor.name.startswith("token_embd."):
                input_bytes += size
                if tensor.name == "token_embd.weight":
                    embd_bytes = size
            else:
                # rope_freqs and friends: small, kept with the input on the coordinator's CPU.
                other_bytes += size
    if not has_output:
        # Tied embeddings: llama.cpp loads a second copy of token_embd as the output matrix.
        output_bytes += embd_bytes

    tokens = fields.get("tokenizer.ggml.tokens")
    n_vocab = (
        tokens["array_length"] if isinstance(tokens, dict) else len(tokens) if isinstance(tokens, list) else 0
    ) or int(_arch_field(fields, arch, "vocab_size", 0) or 0)
    file_type = fields.get("general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name if file_type is not None else None
    except ValueError:
        file_type_name = None
    return {
        "format": "gguf",
        "version": headers[0].version,
        "name": fields.get("general.name", ""),
        "architecture": arch,
        "block_count": n_layer,
        "context_length": int(_arch_field(fields, arch, "context_length", 0) or 0),
        "embedding_length": n_embd,
        "feed_forward_length": _arch_field(fields, arch, "feed_forward_length", 0),
        "head_count": n_head,
        "head_count_kv": n_head_kv,
        "key_length": key_length,
        "value_length": value_length,
        "sliding_window": int(_arch_field(fields, arch, "attention.sliding_window", 0) or 0),
        "swa_layers": _swa_layers(fields, arch, n_layer),
        "expert_count": int(_arch_field(fields, arch, "expert_count", 0) or 0),
        "expert_used_count": int(_arch_field(fields, arch, "expert_used_count", 0) or 0),
        "vocab_size": n_vocab,
        "file_type": file_type,
        "file_type_name": file_type_name,
        "block_weight_bytes": block_bytes,
        "output_bytes": output_bytes,
        "tied_embeddings": not has_output,
        "input_embedding_bytes": input_bytes,
        "other_bytes": other_bytes,
        "weights_total_bytes": total,
        "tensor_count": sum(len(h.tensors) for h in headers),
        "split_count": len(headers),
        "shards": shard_names or [],
    }


def split_count(header: GGUFHeader) -> int:
    return int(header.fields.get("split.count", 1) or 1)


def check_shard(header: GGUFHeader, index: int, count: int, path: str) -> None:
    """Each shard must say it is shard `index` of `count`."""
    no, total = header.fields.get("split.no"), header.fields.get("split.count")
    if total is not None and (int(total) != count or (no is not None and int(no) != index)):
        raise MissingShard(f"{path} is shard {no} of {total}, expected shard {index} of {count}.")


def profile_path(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Profile of a local GGUF model; for a split model `path` is the first shard; the others are found."""
    path = os.fspath(path)
    first = read_header_path(path)
    count = split_count(first)
    paths = shard_paths(path, count)
    headers = [first]
    for index, shard in enumerate(paths[1:], start=1):
        if not os.path.isfile(shard):
            raise MissingShard(f"Shard {index + 1} of {count} is missing: {shard}")
        header = read_header_path(shard)
        check_shard(header, index, count, shard)
        headers.append(header)
    profile = build_profile(headers, shard_names=[os.path.basename(p) for p in paths])
    profile["shard_paths"] = paths
    profile["size_bytes"] = sum(os.path.getsize(p) for p in paths)
    return profile
