"""Read a GGUF file's header and turn it into the planner's memory profile.

Only the header is read: the key/value section and the tensor-info section, never the weights. The parser
takes a `read_range(offset, size) -> bytes` callable so the same code works on a local file, on an SFTP
handle, or on the first bytes of a file already fetched (`parse_header_bytes`). The `gguf` package supplies
the constants (value types, quantisation block sizes); its `GGUFReader` is not used because it memory-maps a
whole local path and builds an object for every element of every array.

A header is input from whoever put the file on the node, so the parser is bounded: every count is checked
against a limit far above any real model before anything in proportion to it is built, long arrays (the
vocabulary, the merges) are stepped over without building a Python object per element, the header may take
at most `MAX_HEADER_BYTES`, and a tensor whose data would lie beyond the end of the file is refused. The
console's pages and jobs parse in a child process with a memory and a time limit on top of that
(llamacpp/gguf_isolated.py).

The profile (a JSON-able dict, stored on `ModelFile.profile`) is what `planning/planner.py` consumes.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, LlamaFileType

from llamacpp.args import EXPERTS_PATTERN
from llamacpp.rpc_cache import HASH_THRESHOLD as RPC_HASH_THRESHOLD

ReadRange = Callable[[int, int], bytes]

SUPPORTED_VERSIONS = (2, 3)

# Limits on what a header may claim. A real model lies far inside each; a header outside one is refused with
# a message naming the field, before anything in proportion to the claim is built (a 182-byte file claiming
# 4,000,000 blocks once cost 186 MiB; arrays cost about 2 µs per element).
# The deepest released models have a few hundred blocks at most (Llama 3.1 405B: 126).
MAX_BLOCKS = 4096
# About 1,100 tensors in Llama 3.1 405B or DeepSeek-V3; a MoE file with every expert as a tensor of its own
# (128 experts × 3 matrices × 60 blocks) has some 23,000.
MAX_TENSORS = 65_536
# Models carry a few dozen metadata keys.
MAX_KV = 4096
# Split models come in a few dozen shards (Hugging Face holds at most 50 GB per file).
MAX_SHARDS = 1024
# The whole header (key/value and tensor-info sections). Llama 3's 128k-token vocabulary with its 280k merges
# takes about 8 MiB, Gemma 3's 262k tokens about 6 MiB.
MAX_HEADER_BYTES = 64 * 2**20
# Array elements kept as Python values, over the whole header: short arrays only (per-layer figures, a tiny
# model's vocabulary); a Python int costs ~36 bytes for 4 bytes of file, so this bounds that growth.
MAX_KEPT_VALUES = 262_144
# Metadata keys and tensor names (llama.cpp allows tensor names of 63 bytes).
MAX_NAME_BYTES = 65_536
_MAX_DIMS = 8
# Arrays longer than this (token lists, merges) are summarised by their length in the profile fields.
_KEEP_ARRAY = 4096
# The largest piece read from the file at once.
_MAX_CHUNK = 8 * 2**20

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
_U64 = struct.Struct("<Q")
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


class OutOfRange(GGUFError):
    """A count, a length or a size in the header lies beyond what any model has (a corrupt or hostile
    file)."""


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


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


class _Cursor:
    """Sequential little-endian reads through `read_range`, fetched in growing chunks, never past
    `MAX_HEADER_BYTES` nor past `file_size` (when known); skipped stretches are not read at all."""

    def __init__(self, read_range: ReadRange, chunk: int = 1 << 20, file_size: int | None = None):
        self._read = read_range
        self._buf = b""
        self._buf_start = 0
        self._chunk = chunk
        self.file_size = file_size
        # Every read ends at or before this; beyond it `_refuse_end` says why.
        self._limit = MAX_HEADER_BYTES if file_size is None else min(MAX_HEADER_BYTES, file_size)
        self.pos = 0
        self.kept = 0  # array elements built as Python values so far

    def _refuse_end(self, end: int, what: str) -> None:
        if end > MAX_HEADER_BYTES:
            raise OutOfRange(
                f"The GGUF header is larger than {_mib(MAX_HEADER_BYTES)} ({what} reaches byte {end}); "
                "a model's header takes a few MiB, so the file is corrupt or not a model."
            )
        if self.file_size is not None and end > self.file_size:
            raise TruncatedHeader(
                f"The GGUF header is cut short at byte {self.file_size} (needed {end}).", needed=end
            )

    def _ensure(self, size: int, what: str) -> None:
        """The buffer holds [pos, pos + size)."""
        end = self.pos + size
        if end > self._limit:
            self._refuse_end(end, what)
        if end > self._buf_start + len(self._buf):
            want = min(max(size, self._chunk), self._limit - self.pos)
            data = self._read(self.pos, want)
            if len(data) < size:
                raise TruncatedHeader(
                    f"The GGUF header is cut short at byte {self.pos + len(data)} (needed {end}).", needed=end
                )
            self._buf, self._buf_start = data, self.pos
            self._chunk = min(self._chunk * 2, _MAX_CHUNK)

    def take(self, size: int, what: str = "the header") -> bytes:
        self._ensure(size, what)
        start = self.pos - self._buf_start
        self.pos += size
        return self._buf[start : start + size]

    def skip(self, size: int, what: str) -> None:
        """Step over `size` bytes without reading them."""
        end = self.pos + size
        if end > self._limit:
            self._refuse_end(end, what)
        self.pos = end

    def skip_strings(self, count: int, what: str) -> None:
        """Step over `count` strings: only their 8-byte lengths are read, nothing is decoded or kept."""
        if self.pos + 8 * count > self._limit:  # each string takes at least its length field
            self._refuse_end(self.pos + 8 * count, what)
        left = count
        while left:
            self._ensure(8, what)
            buf, base = self._buf, self._buf_start
            offset, last = self.pos - base, len(buf) - 8
            while left and offset <= last:
                offset += 8 + _U64.unpack_from(buf, offset)[0]
                left -= 1
            self.pos = base + offset
            if self.pos > self._limit:
                self._refuse_end(self.pos, what)

    def scalar(self, vtype: GGUFValueType, what: str = "the header") -> Any:
        fmt = _SCALAR[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self, what: str = "a string", limit: int | None = None) -> str:
        at = self.pos
        length = self.u64()
        if limit is not None and length > limit:
            raise OutOfRange(
                f"{what.capitalize()} at byte {at} is {length} bytes long; a GGUF model's are at most "
                f"{limit}: the header is corrupt."
            )
        return self.take(length, what).decode("utf-8", errors="replace")

    def keep(self, count: int, what: str) -> None:
        self.kept += count
        if self.kept > MAX_KEPT_VALUES:
            raise OutOfRange(
                f"The GGUF header holds more than {MAX_KEPT_VALUES} values in short arrays (at {what}); "
                "a model has a few thousand: the header is corrupt."
            )


def _value_type(cur: _Cursor, vtype: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(vtype)
    except ValueError:
        raise GGUFError(
            f"Unknown GGUF value type {vtype} for {key} at byte {cur.pos}: the header is corrupt."
        ) from None


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    vtype = _value_type(cur, vtype, key)
    if vtype == GGUFValueType.STRING:
        return cur.string(key)
    if vtype == GGUFValueType.ARRAY:
        item_type = _value_type(cur, cur.u32(), key)
        count = cur.u64()
        if item_type == GGUFValueType.ARRAY:
            raise GGUFError(
                f"{key} is an array of arrays, which llama.cpp does not read: the file is corrupt."
            )
        if count > _KEEP_ARRAY:
            # Summarised by its length: stepped over, no Python object per element.
            if item_type == GGUFValueType.STRING:
                cur.skip_strings(count, key)
            else:
                cur.skip(count * struct.calcsize(_SCALAR[item_type]), key)
            return {"array_length": count}
        cur.keep(count, key)
        if item_type == GGUFValueType.STRING:
            return [cur.string(key) for _ in range(count)]
        fmt = _SCALAR[item_type]
        return list(struct.unpack(f"<{count}{fmt[1]}", cur.take(count * struct.calcsize(fmt), key)))
    return cur.scalar(vtype, key)


def _describe(magic: bytes) -> str:
    """The first bytes of a file in plain words: as text when they are printable, else in hex."""
    text = magic.decode("ascii", errors="replace")
    if text.isprintable() and "\ufffd" not in text:
        return f"“{text}”"
    return "the bytes " + " ".join(f"{b:02x}" for b in magic)


def _alignment(fields: dict[str, Any]) -> int:
    alignment = fields.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 0:
        raise GGUFError(f"general.alignment is {alignment!r}, not a whole number: the header is corrupt.")
    alignment = alignment or 32
    if alignment & (alignment - 1):
        raise GGUFError(f"general.alignment is {alignment}, not a power of two: the header is corrupt.")
    return alignment


def parse_header(read_range: ReadRange, *, file_size: int | None = None) -> GGUFHeader:
    """Parse the key/value and tensor-info sections through `read_range(offset, size)`.

    `read_range` may return fewer bytes than asked at the end of the file; the parser raises
    `TruncatedHeader` only when it actually needs the missing bytes. With `file_size` (the file's real size)
    a header reaching past it is cut short, and so is a tensor whose data would lie beyond it.
    """
    cur = _Cursor(read_range, file_size=file_size)
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
    if tensor_count > MAX_TENSORS:
        raise OutOfRange(f"The header claims {tensor_count} tensors; a GGUF model has at most {MAX_TENSORS}.")
    if kv_count > MAX_KV:
        raise OutOfRange(f"The header claims {kv_count} metadata keys; a GGUF model has at most {MAX_KV}.")
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string("a metadata key", limit=MAX_NAME_BYTES)
        fields[key] = _value(cur, cur.u32(), key)
    tensors = []
    for _ in range(tensor_count):
        name = cur.string("a tensor name", limit=MAX_NAME_BYTES)
        n_dims = cur.u32()
        if n_dims > _MAX_DIMS:
            raise GGUFError(f"Tensor {name!r} claims {n_dims} dimensions: the header is corrupt.")
        shape = list(struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, "a tensor's shape")))
        ggml_type = cur.u32()
        if ggml_type not in GGML_QUANT_SIZES:
            raise GGUFError(f"Tensor {name!r} has unknown type {ggml_type}.")
        tensors.append(TensorInfo(name=name, shape=shape, ggml_type=ggml_type, offset=cur.u64()))
    alignment = _alignment(fields)
    data_offset = -(-cur.pos // alignment) * alignment
    if file_size is not None:
        for tensor in tensors:
            end = data_offset + tensor.offset + tensor.n_bytes
            if end > file_size:
                raise OutOfRange(
                    f"Tensor {tensor.name!r} lies beyond the end of the file: its data would end at byte "
                    f"{end}, the file has {file_size} bytes."
                )
    return GGUFHeader(version=version, fields=fields, tensors=tensors, data_offset=data_offset)


def parse_header_bytes(data: bytes, *, file_size: int | None = None) -> GGUFHeader:
    """Parse from the first bytes of a file. Raises `TruncatedHeader` (with `.needed`) if they are too few."""

    def read_range(offset: int, size: int) -> bytes:
        return data[offset : offset + size]

    return parse_header(read_range, file_size=file_size)


def read_header_path(path: str | os.PathLike[str]) -> GGUFHeader:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path):
            # A FIFO or a device would block or never end; only a regular file is a model.
            raise GGUFError(f"{path} is not a regular file.")
        with open(path, "rb") as fh:

            def read_range(offset: int, size: int) -> bytes:
                fh.seek(offset)
                return fh.read(size)

            return parse_header(read_range, file_size=os.fstat(fh.fileno()).st_size)
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


def _as_gguf_error(function):
    """A value of the wrong kind in a corrupt or hostile header (text where a count belongs, a list for a
    number) becomes a GGUFError the form can show, not an exception."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except GGUFError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            message = f"The header holds a value of the wrong kind ({exc}): the file is corrupt."
            raise GGUFError(message) from None

    return wrapper


def _bounded(value: Any, name: str, maximum: int, unit: str) -> int:
    """`value` as a count between 1 and `maximum`, or a GGUFError naming `name`."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise GGUFError(f"{name} is {value!r:.80}, not a whole number: the header is corrupt.") from None
    if number > maximum:
        raise OutOfRange(f"{name} is {number}; a GGUF model has at most {maximum} {unit}.")
    if number < 1:
        raise OutOfRange(f"{name} is {number}, not a number of {unit}: the header is corrupt.")
    return number


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
# A block's routed experts: llama.cpp's own pattern for them (LLM_FFN_EXPS_REGEX in common/common.h, what
# --n-cpu-moe moves), so the bytes counted here are the bytes an `-ot` rule moves. Shared experts
# (`ffn_*_shexp`) and the router (`ffn_gate_inp`) run for every token and count as the block's dense part.
_EXPERTS_RE = re.compile(r"^blk\.\d+" + EXPERTS_PATTERN)


@_as_gguf_error
def build_profile(headers: list[GGUFHeader], *, shard_names: list[str] | None = None) -> dict[str, Any]:
    """The planner's memory profile from the headers of every shard (first shard first)."""
    tensor_count = sum(len(h.tensors) for h in headers)
    if tensor_count > MAX_TENSORS:
        raise OutOfRange(f"The shards hold {tensor_count} tensors; a GGUF model has at most {MAX_TENSORS}.")
    fields = headers[0].fields
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("The file has no general.architecture: it is not a model.")
    n_layer = _arch_field(fields, arch, "block_count")
    n_embd = _arch_field(fields, arch, "embedding_length")
    n_head_field = _arch_field(fields, arch, "attention.head_count")
    if not n_layer or not n_embd or n_head_field is None:
        raise GGUFError(f"{arch}: block_count, embedding_length or attention.head_count is missing.")
    # Bounded before the per-layer lists below are built from it.
    n_layer, n_embd = _bounded(n_layer, f"{arch}.block_count", MAX_BLOCKS, "blocks"), int(n_embd)
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
    expert_bytes = [0] * n_layer
    # What ggml-rpc-server's cache cannot hold (tensors of HASH_THRESHOLD bytes or fewer cross the link at
    # every load) and how many tensors it can (one hash round trip each): planning/first_word.py.
    block_small = [0] * n_layer
    block_large = [0] * n_layer
    output_small = output_large = 0
    output_bytes = input_bytes = other_bytes = 0
    has_output = False
    embd_bytes = 0
    total = 0
    # Where each group of tensors lies in each shard's data: {shard: [first byte, end]}. llama.cpp maps the
    # coordinator CPU's tensors as one range per shard, from its first tensor to the end of its last
    # (llama_model_loader::get_mapping_range), so what its CPU holds depends on the order of the file.
    block_spans: list[dict[int, list[int]]] = [{} for _ in range(n_layer)]
    # A mixture of experts: the same by block for its routed experts and for the rest of it, which `-ot`
    # rules may place on different devices (planning/costs.py `cpu_mapped_bytes`).
    expert_spans: list[dict[int, list[int]]] = [{} for _ in range(n_layer)]
    dense_spans: list[dict[int, list[int]]] = [{} for _ in range(n_layer)]
    group_spans: dict[str, dict[int, list[int]]] = {"input": {}, "output": {}, "other": {}}
    for shard, header in enumerate(headers):
        for tensor in header.tensors:
            size = tensor.n_bytes
            total += size
            match = _BLOCK_RE.match(tensor.name)
            if match and int(match[1]) < n_layer:
                block_bytes[int(match[1])] += size
                if size > RPC_HASH_THRESHOLD:
                    block_large[int(match[1])] += 1
                else:
                    block_small[int(match[1])] += size
                part = dense_spans
                if _EXPERTS_RE.match(tensor.name):
                    expert_bytes[int(match[1])] += size
                    part = expert_spans
                _widen_span(part[int(match[1])], shard, tensor.offset, size)
                spans = block_spans[int(match[1])]
            elif tensor.name == "output.weight":
                output_bytes += size
                has_output = True
                output_large += size > RPC_HASH_THRESHOLD
                output_small += 0 if size > RPC_HASH_THRESHOLD else size
                spans = group_spans["output"]
            elif tensor.name.startswith("output_norm."):
                output_bytes += size
                output_small += size
                spans = group_spans["output"]
            elif tensor.name.startswith("token_embd."):
                input_bytes += size
                if tensor.name == "token_embd.weight":
                    embd_bytes = size
                spans = group_spans["input"]
            else:
                # rope_freqs and friends: small, kept with the input on the coordinator's CPU.
                other_bytes += size
                spans = group_spans["other"]
            _widen_span(spans, shard, tensor.offset, size)
    tied_output_bytes = 0
    if not has_output:
        # Tied embeddings: the output matrix is token_embd. A device other than the coordinator's CPU gets a
        # copy of it; on that CPU it is the input's own (mapped once).
        output_bytes += embd_bytes
        tied_output_bytes = embd_bytes
        output_large += embd_bytes > RPC_HASH_THRESHOLD
        output_small += 0 if embd_bytes > RPC_HASH_THRESHOLD else embd_bytes

    tokens = fields.get("tokenizer.ggml.tokens")
    n_vocab = (
        tokens["array_length"] if isinstance(tokens, dict) else len(tokens) if isinstance(tokens, list) else 0
    ) or int(_arch_field(fields, arch, "vocab_size", 0) or 0)
    file_type = fields.get("general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name if file_type is not None else None
    except (ValueError, TypeError):
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
        # Every tensor of a block, and (part of it) its routed experts', of which a token reads
        # expert_used_count of expert_count (planning/costs.py).
        "block_weight_bytes": block_bytes,
        "block_expert_bytes": expert_bytes,
        "output_bytes": output_bytes,
        "block_small_bytes": block_small,
        "block_large_tensors": block_large,
        "output_small_bytes": output_small,
        "output_large_tensors": output_large,
        "tied_embeddings": not has_output,
        "tied_output_bytes": tied_output_bytes,
        "tensor_spans": {
            **{group: _span_list(spans) for group, spans in group_spans.items()},
            "blocks": [_span_list(spans) for spans in block_spans],
            **(
                {
                    "block_experts": [_span_list(spans) for spans in expert_spans],
                    "block_dense": [_span_list(spans) for spans in dense_spans],
                }
                if any(expert_bytes)
                else {}
            ),
        },
        "input_embedding_bytes": input_bytes,
        "other_bytes": other_bytes,
        "weights_total_bytes": total,
        "tensor_count": sum(len(h.tensors) for h in headers),
        "split_count": len(headers),
        "shards": shard_names or [],
    }


def _widen_span(spans: dict[int, list[int]], shard: int, offset: int, size: int) -> None:
    span = spans.setdefault(shard, [offset, offset + size])
    span[0], span[1] = min(span[0], offset), max(span[1], offset + size)


def _span_list(spans: dict[int, list[int]]) -> list[list[int]]:
    """[[shard, first byte, end], ...] (JSON keeps no integer keys)."""
    return [[shard, start, end] for shard, (start, end) in sorted(spans.items())]


def split_count(header: GGUFHeader) -> int:
    return _bounded(header.fields.get("split.count", 1) or 1, "split.count", MAX_SHARDS, "shards")


@_as_gguf_error
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
