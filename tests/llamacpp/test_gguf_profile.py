"""Reading GGUF headers into the planner's memory profile, checked against gguf's own reader."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from llamacpp import gguf as gguf_profile
from llamacpp.gguf import GGUFError, MissingShard, NotGGUF, TruncatedHeader, UnsupportedVersion
from llamacpp.tiny_model import TinyLlama, write_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {
        "gqa": write_tiny_llama(root / "gqa.gguf", TinyLlama()),
        "tied": write_tiny_llama(root / "tied.gguf", TinyLlama(tied_embeddings=True)),
        "split": write_tiny_llama(root / "split.gguf", TinyLlama(shards=2)),
    }


def test_profile_of_a_gqa_llama_matches_ggufs_own_reader(models):
    profile = gguf_profile.profile_path(models["gqa"])
    reader = gguf.GGUFReader(models["gqa"])
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert profile["architecture"] == "llama"
    assert profile["block_count"] == 8
    assert profile["head_count_kv"] == [2] * 8 and profile["head_count"] == [8] * 8
    assert profile["key_length"] == profile["value_length"] == [32] * 8
    assert profile["context_length"] == 4096
    assert profile["file_type_name"] == "MOSTLY_F16"
    assert profile["vocab_size"] == 3 + 256 + 13
    assert profile["block_weight_bytes"][3] == sum(v for k, v in sizes.items() if k.startswith("blk.3."))
    assert profile["output_bytes"] == sizes["output.weight"] + sizes["output_norm.weight"]
    assert profile["input_embedding_bytes"] == sizes["token_embd.weight"]
    assert profile["weights_total_bytes"] == sum(sizes.values())
    assert profile["tied_embeddings"] is False
    assert profile["split_count"] == 1 and profile["sliding_window"] == 0 and profile["expert_count"] == 0


def test_tied_embeddings_put_a_copy_of_token_embd_with_the_output_layer(models):
    profile = gguf_profile.profile_path(models["tied"])
    assert profile["tied_embeddings"] is True
    assert profile["output_bytes"] == profile["input_embedding_bytes"] + 256 * 4  # + output_norm (f32)


def test_a_split_model_is_found_from_its_first_shard_and_summed(models):
    first = models["split"]
    assert first.name == "split-00001-of-00002.gguf"
    profile = gguf_profile.profile_path(first)
    whole = gguf_profile.profile_path(models["gqa"])
    assert profile["split_count"] == 2
    assert profile["shards"] == ["split-00001-of-00002.gguf", "split-00002-of-00002.gguf"]
    assert profile["block_weight_bytes"] == whole["block_weight_bytes"]
    assert profile["output_bytes"] == whole["output_bytes"]


def test_a_missing_shard_is_named(models, tmp_path):
    lonely = tmp_path / "split-00001-of-00002.gguf"
    lonely.write_bytes(models["split"].read_bytes())
    with pytest.raises(MissingShard, match="Shard 2 of 2 is missing"):
        gguf_profile.profile_path(lonely)


def test_the_header_parses_from_its_first_bytes_only(models):
    data = models["gqa"].read_bytes()
    header = gguf_profile.read_header_path(models["gqa"])
    assert header.data_offset < len(data) // 10  # the header is a small part of the file
    from_prefix = gguf_profile.parse_header_bytes(data[: header.data_offset])
    assert [t.name for t in from_prefix.tensors] == [t.name for t in header.tensors]
    with pytest.raises(TruncatedHeader) as info:
        gguf_profile.parse_header_bytes(data[: header.data_offset // 2])
    assert info.value.needed > header.data_offset // 2


def test_read_range_is_asked_only_for_the_header(models):
    data = models["gqa"].read_bytes()
    asked = []

    def read_range(offset: int, size: int) -> bytes:
        asked.append((offset, size))
        return data[offset : offset + size]

    header = gguf_profile.parse_header(read_range)
    assert max(offset for offset, _ in asked) < header.data_offset


def test_not_gguf_truncated_and_unsupported_version_are_clear_errors(models, tmp_path):
    text = tmp_path / "readme.gguf"
    text.write_text("# not a model\n" * 10)
    with pytest.raises(NotGGUF, match="not a GGUF file"):
        gguf_profile.profile_path(text)
    data = models["gqa"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:5000])
    with pytest.raises(TruncatedHeader, match="cut short"):
        gguf_profile.profile_path(cut)
    old = tmp_path / "v1.gguf"
    old.write_bytes(data[:4] + struct.pack("<I", 1) + data[8:])
    with pytest.raises(UnsupportedVersion, match="version 1"):
        gguf_profile.profile_path(old)
    with pytest.raises(GGUFError, match="directory"):
        gguf_profile.profile_path(tmp_path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(NotGGUF):
        gguf_profile.profile_path(empty)


def test_a_mixture_of_experts_tells_its_experts_bytes_from_the_rest_of_each_block(tmp_path):
    path = write_tiny_llama(tmp_path / "moe.gguf", TinyLlama(n_layer=4, n_expert=8, n_expert_used=2))
    profile = gguf_profile.profile_path(path)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    experts = sum(sizes[f"blk.2.ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
    assert experts == 3 * 8 * 512 * 256 * 2  # three f16 matrices of n_ff x n_embd per expert
    assert profile["block_expert_bytes"] == [experts] * 4
    # The router and the attention stay in the block's dense part.
    dense = sum(v for k, v in sizes.items() if k.startswith("blk.2.")) - experts
    assert dense >= sizes["blk.2.ffn_gate_inp.weight"] + sizes["blk.2.attn_q.weight"]
    assert profile["block_weight_bytes"][2] == dense + experts
    assert (profile["expert_count"], profile["expert_used_count"]) == (8, 2)


def test_shared_experts_count_as_dense_and_a_dense_model_has_no_expert_bytes(models, tmp_path):
    assert gguf_profile.profile_path(models["gqa"])["block_expert_bytes"] == [0] * 8
    path = tmp_path / "shexp.gguf"
    writer = gguf.GGUFWriter(path, "qwen2moe")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_expert_count(4)
    writer.add_expert_used_count(1)
    matrix = np.zeros((4, 32, 64), dtype=np.float16)
    writer.add_tensor("blk.0.ffn_up_exps.weight", matrix)
    writer.add_tensor("blk.0.ffn_up_shexp.weight", np.zeros((32, 64), dtype=np.float16))
    writer.add_tensor("blk.0.ffn_gate_inp_shexp.weight", np.zeros((1, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    profile = gguf_profile.profile_path(path)
    assert profile["block_expert_bytes"] == [4 * 32 * 64 * 2]
    assert profile["block_weight_bytes"] == [4 * 32 * 64 * 2 + 32 * 64 * 2 + 64 * 2]
