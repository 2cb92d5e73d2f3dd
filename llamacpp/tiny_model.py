"""Tiny llama-architecture GGUF models, written with the `gguf` package's GGUFWriter.

Random f16 weights and a byte-fallback SPM vocabulary (`<unk>`, `<s>`, `</s>`, the 256 `<0xNN>` byte tokens
and a few word pieces): llama-server loads and serves them (the text is gibberish, the plumbing is real).
The console uses them where it needs a model of known shape and no download: calibration runs, the compose
trial's demo model, and the tests. Variants: grouped-query attention, tied embeddings (no `output.weight`),
a split into shards, and a mixture of experts (Mixtral-style: llama.cpp's `llama` architecture with
`expert_count`, a router `ffn_gate_inp` and the experts stacked in `ffn_{gate,up,down}_exps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class TinyLlama:
    n_layer: int = 8
    n_embd: int = 256
    n_head: int = 8
    n_head_kv: int = 2
    n_ff: int = 512
    n_ctx_train: int = 4096
    tied_embeddings: bool = False
    # More than one: write `NAME-0000k-of-0000N.gguf` shards and return the first.
    shards: int = 1
    # More than 0: every block's feed-forward is this many experts of n_ff each, n_expert_used per token.
    n_expert: int = 0
    n_expert_used: int = 2
    seed: int = 1234


_PIECES = ["▁the", "▁a", "▁and", "▁to", "▁of", "▁in", "▁is", "▁it", "▁that", "▁hello", "▁world", "ing", "ed"]


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(_PIECES))]
    types = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        *([gguf.TokenType.BYTE] * 256),
        *([gguf.TokenType.NORMAL] * len(_PIECES)),
    ]
    return tokens, scores, [int(t) for t in types]


def _tensors(spec: TinyLlama, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.n_embd // spec.n_head
    n_embd_kv = head_dim * spec.n_head_kv

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(spec.n_embd, dtype=np.float32)

    # numpy shapes are the reverse of ggml's ne order: (rows, columns) = (n_out, n_in).
    out = [("token_embd.weight", weight(n_vocab, spec.n_embd))]
    for i in range(spec.n_layer):
        out += [
            (f"blk.{i}.attn_norm.weight", norm()),
            (f"blk.{i}.attn_q.weight", weight(spec.n_embd, spec.n_embd)),
            (f"blk.{i}.attn_k.weight", weight(n_embd_kv, spec.n_embd)),
            (f"blk.{i}.attn_v.weight", weight(n_embd_kv, spec.n_embd)),
            (f"blk.{i}.attn_output.weight", weight(spec.n_embd, spec.n_embd)),
            (f"blk.{i}.ffn_norm.weight", norm()),
        ]
        if spec.n_expert:
            out += [
                (f"blk.{i}.ffn_gate_inp.weight", weight(spec.n_expert, spec.n_embd)),
                (f"blk.{i}.ffn_gate_exps.weight", weight(spec.n_expert, spec.n_ff, spec.n_embd)),
                (f"blk.{i}.ffn_up_exps.weight", weight(spec.n_expert, spec.n_ff, spec.n_embd)),
                (f"blk.{i}.ffn_down_exps.weight", weight(spec.n_expert, spec.n_embd, spec.n_ff)),
            ]
        else:
            out += [
                (f"blk.{i}.ffn_gate.weight", weight(spec.n_ff, spec.n_embd)),
                (f"blk.{i}.ffn_up.weight", weight(spec.n_ff, spec.n_embd)),
                (f"blk.{i}.ffn_down.weight", weight(spec.n_embd, spec.n_ff)),
            ]
    out.append(("output_norm.weight", norm()))
    if not spec.tied_embeddings:
        out.append(("output.weight", weight(n_vocab, spec.n_embd)))
    return out


def write_tiny_llama(path: str | Path, spec: TinyLlama | None = None) -> Path:
    """Write the model; returns the path to pass to llama-server (the first shard for split models)."""
    spec = spec or TinyLlama()
    path = Path(path)
    tokens, scores, types = _vocab()
    tensors = _tensors(spec, len(tokens))
    split_max = 0 if spec.shards <= 1 else -(-len(tensors) // spec.shards)
    writer = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max)
    writer.add_name("ramdeck tiny llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    if spec.n_expert:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    for name, array in tensors:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if spec.shards > 1:
        return path.with_name(gguf.gguf_writer.SHARD_NAME_FORMAT.format(path.stem, 1, spec.shards))
    return path
