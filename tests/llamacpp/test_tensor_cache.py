"""Filling an RPC cache from a local copy of the model: the FNV-1a names ggml-rpc-server gives its cache
files, which tensors a worker's blocks need, and the POSIX fill script run for real (sh, tail, head,
sha256sum) on files with hostile names. That the names are the ones rpc-server looks up is proved against a
real rpc-server in tests/deployments/test_rpc_cache_lab.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGUFReader

from llamacpp import gguf as gguf_profile
from llamacpp import rpc_cache, tensor_cache
from llamacpp.rpc_cache import CacheError
from llamacpp.tiny_model import TinyLlama, write_tiny_llama

# Folders and files named to break a script that pasted them into its text.
HOSTILE = "we ird $(touch PWNED) `id` ;'\"*"


def test_the_hash_is_fnv1a_64_as_ggml_rpc_computes_it():
    # The published FNV-1a 64 test vectors (offset basis cbf29ce484222325, prime 100000001b3).
    assert tensor_cache.fnv1a_64(b"") == "cbf29ce484222325"
    assert tensor_cache.fnv1a_64(b"a") == "af63dc4c8601ec8c"
    assert tensor_cache.fnv1a_64(b"foobar") == "85944171f73967e8"


@pytest.fixture
def small_threshold(monkeypatch):
    # The tiny model's matrices are 128 KiB to 320 KiB: every one above this is "cacheable".
    monkeypatch.setattr(tensor_cache, "HASH_THRESHOLD", 64 * 1024)


def _hashes(path: Path) -> dict:
    header = gguf_profile.read_header_path(path)
    with open(path, "rb") as fh:

        def read_range(offset: int, size: int) -> bytes:
            fh.seek(offset)
            return fh.read(size)

        return tensor_cache.hash_tensors(read_range, header)


def test_each_cacheable_tensor_is_hashed_from_the_files_bytes_at_its_offset(tmp_path, small_threshold):
    path = write_tiny_llama(tmp_path / "m.gguf", TinyLlama(n_layer=2))
    hashes = _hashes(path)
    reader = GGUFReader(path)
    big = {t.name: bytes(t.data.tobytes()) for t in reader.tensors if t.n_bytes > 64 * 1024}
    assert {e["name"] for e in hashes["tensors"]} == set(big) and len(big) >= 8
    for entry in hashes["tensors"]:
        data = big[entry["name"]]
        assert entry["size"] == len(data)
        assert entry["fnv"] == tensor_cache.fnv1a_64(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert path.read_bytes()[entry["offset"] : entry["offset"] + entry["size"]] == data
    # The norms (1 KiB) stay under the threshold and are never offered by hash.
    assert not any("norm" in e["name"] for e in hashes["tensors"])


def test_a_worker_gets_the_tensors_of_its_blocks_and_the_output_layer_only_where_it_holds_it(
    tmp_path, small_threshold
):
    hashes = _hashes(write_tiny_llama(tmp_path / "m.gguf", TinyLlama(n_layer=4)))
    middle = tensor_cache.tensors_for(hashes, [{"first_layer": 1, "layers": 2, "output_layer": False}])
    assert {e["name"].split(".")[1] for e in middle} == {"1", "2"}
    last = tensor_cache.tensors_for(hashes, [{"first_layer": 3, "layers": 1, "output_layer": True}])
    names = {e["name"] for e in last}
    assert "output.weight" in names and "token_embd.weight" not in names
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"3"}
    tied = _hashes(write_tiny_llama(tmp_path / "t.gguf", TinyLlama(n_layer=2, tied_embeddings=True)))
    # Tied embeddings: llama.cpp places a copy of token_embd with the output layer.
    out = tensor_cache.tensors_for(tied, [{"first_layer": 1, "layers": 1, "output_layer": True}])
    assert "token_embd.weight" in {e["name"] for e in out}
    assert tensor_cache.held(hashes, [e["fnv"] for e in middle]) == (
        len(middle),
        len(hashes["tensors"]),
        sum(e["size"] for e in middle),
    )


def _fill(folder: str, source: str | list[str], entries: list[dict], env: dict | None = None) -> dict:
    found: dict = {"have": [], "filled": [], "bad": []}
    if isinstance(source, list):
        argvs = tensor_cache.fill_argvs_shards(folder, source, entries)
    else:
        argvs = tensor_cache.fill_argvs(folder, source, entries)
    for argv in argvs:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
        assert done.returncode == 0, done.stderr
        part = tensor_cache.parse_fill(done.stdout)
        for key in found:
            found[key] += part[key]
        found["dir"], found["free_bytes"] = part["dir"], part["free_bytes"]
    return found


def _entries(data: bytes, cuts: list[tuple[int, int]]) -> list[dict]:
    return [
        {
            "name": f"t{i}",
            "offset": off,
            "size": n,
            "fnv": tensor_cache.fnv1a_64(data[off : off + n]),
            "sha256": hashlib.sha256(data[off : off + n]).hexdigest(),
        }
        for i, (off, n) in enumerate(cuts)
    ]


def test_the_fill_script_cuts_each_tensor_into_its_cache_name_through_hostile_paths(tmp_path):
    data = os.urandom(3 * 2**20 + 12345)
    folder = tmp_path / HOSTILE / "cache"
    source = tmp_path / HOSTILE / "model copy.gguf"
    source.parent.mkdir(parents=True)
    source.write_bytes(data)
    cuts = [(0, 4096), (4096, 2**20), (2**20 + 7, 2 * 2**20), (len(data) - 100, 100)]
    entries = _entries(data, cuts)
    os.chdir(tmp_path)
    found = _fill(str(folder), str(source), entries)
    rpc = folder / "rpc"
    assert found["dir"] == str(rpc) and found["free_bytes"] > 0
    assert sorted(n for n, _ in found["filled"]) == sorted(e["fnv"] for e in entries) and not found["bad"]
    for entry, (off, n) in zip(entries, cuts, strict=True):
        assert (rpc / entry["fnv"]).read_bytes() == data[off : off + n]
    assert sorted(p.name for p in rpc.iterdir()) == sorted(e["fnv"] for e in entries)  # no temporary left
    assert not (tmp_path / "PWNED").exists() and not list(tmp_path.rglob("PWNED"))

    # Again: every entry is there already, nothing is written.
    again = _fill(str(folder), str(source), entries)
    assert sorted(again["have"]) == sorted(e["fnv"] for e in entries) and not again["filled"]


def test_a_copy_that_differs_from_the_model_fills_nothing_under_a_real_name(tmp_path):
    data = os.urandom(2 * 2**20)
    source = tmp_path / "copy.gguf"
    entries = _entries(data, [(0, 2**20), (2**20, 2**20)])
    changed = bytearray(data)
    changed[2**20 + 5] ^= 0xFF
    source.write_bytes(bytes(changed))
    found = _fill(str(tmp_path / "c"), str(source), entries)
    assert [n for n, _ in found["filled"]] == [entries[0]["fnv"]]
    assert found["bad"] == [(entries[1]["fnv"], "checksum differs")]
    # A copy cut short: the piece is short, refused.
    source.write_bytes(data[: 2**20 + 10])
    short = _fill(str(tmp_path / "d"), str(source), entries[1:])
    assert short["bad"] and short["bad"][0][1].startswith("cut 10 of")
    assert sorted(p.name for p in (tmp_path / "c" / "rpc").iterdir()) == [entries[0]["fnv"]]
    assert list((tmp_path / "d" / "rpc").iterdir()) == []


def test_the_fill_script_uses_llama_cpps_default_folder_when_the_node_names_none(tmp_path):
    data = os.urandom(5000)
    (tmp_path / "m.gguf").write_bytes(data)
    env = {**os.environ, "LLAMA_CACHE": str(tmp_path / "lc")}
    found = _fill("", str(tmp_path / "m.gguf"), _entries(data, [(10, 4000)]), env=env)
    assert found["dir"] == str(tmp_path / "lc" / "rpc") and len(found["filled"]) == 1


def test_the_fill_script_refuses_bad_input_before_it_runs():
    good = {"name": "x", "offset": 0, "size": 10, "fnv": "0" * 16, "sha256": "a" * 64}
    with pytest.raises(CacheError, match="absolute"):
        tensor_cache.fill_argvs("", "relative/model.gguf", [good])
    with pytest.raises(CacheError, match="absolute"):
        tensor_cache.fill_argvs("cache", "/m.gguf", [good])
    with pytest.raises(CacheError, match="printable"):
        tensor_cache.fill_argvs("", "/m\n.gguf", [good])
    for bad in ({"fnv": "../../etc/passwd"}, {"fnv": "0" * 15 + "G"}, {"sha256": "x"}, {"offset": -1}):
        with pytest.raises(CacheError, match="no valid hash"):
            tensor_cache.fill_argvs("", "/m.gguf", [{**good, **bad}])
    # Many tensors go in several runs, none longer than BATCH tensors.
    argvs = tensor_cache.fill_argvs("", "/m.gguf", [good] * (tensor_cache.BATCH + 1))
    assert [len(a) - 6 for a in argvs] == [4 * tensor_cache.BATCH, 4]


def test_the_script_refuses_a_missing_copy_with_a_message(tmp_path):
    [argv] = tensor_cache.fill_argvs(str(tmp_path), str(tmp_path / "gone.gguf"), [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3 and "is not a readable file" in done.stderr


def test_the_cache_script_names_its_entries_so_the_node_page_can_match_them_to_models(tmp_path):
    rpc = tmp_path / "rpc"
    rpc.mkdir()
    for name in ("00000000000000aa", "00000000000000bb", "not-an-entry", ".fill-00000000000000cc.1"):
        (rpc / name).write_bytes(b"x" * 10)
    done = subprocess.run(rpc_cache.script_argv("usage", str(tmp_path)), capture_output=True, text=True)
    found = rpc_cache.parse(done.stdout)
    assert sorted(found["names"]) == ["00000000000000aa", "00000000000000bb"] and found["entries"] == 2
    cleared = rpc_cache.parse(
        subprocess.run(rpc_cache.script_argv("clear", str(tmp_path)), capture_output=True, text=True).stdout
    )
    assert cleared["names"] == [] and cleared["entries"] == 0


def _split_hashes(first: Path, shards: int) -> tuple[list[str], dict]:
    paths = gguf_profile.shard_paths(str(first), shards)

    def reader(path: str):
        return lambda offset, size: Path(path).read_bytes()[offset : offset + size]

    return paths, tensor_cache.hash_shards([(reader(p), gguf_profile.read_header_path(p)) for p in paths])


def test_a_split_models_tensors_are_hashed_each_in_its_own_shard_at_its_offset_there(
    tmp_path, small_threshold
):
    spec = TinyLlama(n_layer=4)
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = _hashes(write_tiny_llama(tmp_path / "whole" / "m.gguf", spec))
    paths, split = _split_hashes(write_tiny_llama(tmp_path / "split" / "m.gguf", replace(spec, shards=3)), 3)
    assert [Path(p).name for p in paths] == [
        "m-00001-of-00003.gguf",
        "m-00002-of-00003.gguf",
        "m-00003-of-00003.gguf",
    ]
    # The same tensors with the same bytes as the single file (the same seed), each found in one shard.
    assert sorted((e["name"], e["fnv"]) for e in split["tensors"]) == sorted(
        (e["name"], e["fnv"]) for e in whole["tensors"]
    )
    assert {e["shard"] for e in split["tensors"]} == {0, 1, 2}
    assert {e["shard"] for e in whole["tensors"]} == {0}
    for shard, path in enumerate(paths):
        data = {t.name: bytes(t.data.tobytes()) for t in GGUFReader(path).tensors}
        for entry in (e for e in split["tensors"] if e["shard"] == shard):
            assert entry["name"] in data
            assert (
                Path(path).read_bytes()[entry["offset"] : entry["offset"] + entry["size"]]
                == data[entry["name"]]
            )
    assert tensor_cache.valid(split, shards=3)
    # A record written before entries named their shard (single-file models only) stays valid for its model,
    # not for a split one.
    old = {**whole, "tensors": [{k: v for k, v in e.items() if k != "shard"} for e in whole["tensors"]]}
    assert tensor_cache.valid(old) and not tensor_cache.valid(old, shards=3)


def test_the_fill_cuts_each_tensor_of_a_split_model_from_its_own_shards_copy(tmp_path, small_threshold):
    paths, hashes = _split_hashes(write_tiny_llama(tmp_path / "m.gguf", TinyLlama(n_layer=2, shards=2)), 2)
    copies = tmp_path / HOSTILE / "copy"
    copies.mkdir(parents=True)
    for path in paths:
        (copies / Path(path).name).write_bytes(Path(path).read_bytes())
    sources = [str(copies / Path(p).name) for p in paths]
    entries = hashes["tensors"]
    argvs = tensor_cache.fill_argvs_shards(str(tmp_path / "cache"), sources, entries)
    # One run per shard, each naming its own shard's copy.
    assert [argv[5] for argv in argvs] == sources
    os.chdir(tmp_path)
    found = _fill(str(tmp_path / "cache"), sources, entries)
    assert sorted(n for n, _ in found["filled"]) == sorted(e["fnv"] for e in entries) and not found["bad"]
    rpc = tmp_path / "cache" / "rpc"
    for entry in entries:
        data = Path(paths[entry["shard"]]).read_bytes()
        assert (rpc / entry["fnv"]).read_bytes() == data[entry["offset"] : entry["offset"] + entry["size"]]
    assert not list(tmp_path.rglob("PWNED"))
    # An entry that names a shard the copy does not have is refused before anything runs.
    with pytest.raises(CacheError, match="lies in shard 2, but the copy has 2 file"):
        tensor_cache.fill_argvs_shards("", sources, [{**entries[0], "shard": 2}])
