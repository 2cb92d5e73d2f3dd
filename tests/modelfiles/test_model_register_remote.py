"""Registering a model that lives on a remote node: the register view reads only GGUF headers, over real SFTP
to a lab host's sshd; split models find their other shards beside the first; bad files are refused with a
message naming the problem and nothing is registered."""

from __future__ import annotations

import html
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from asgiref.sync import async_to_sync
from django.urls import reverse

from audit.models import AuditEvent
from llamacpp import gguf as gguf_profile
from llamacpp import gguf_isolated
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from modelfiles.register import HEAD_FIRST_READ, read_header
from remote.local import LocalTransport
from remote.ssh import SSHTransport
from tests.deploy_fixtures import lab_node
from tests.gguf_files import BLOCKS_MESSAGE, HOSTILE_BLOCKS

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def fast_ssh(settings):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0


@pytest.fixture
def sftp_reads(monkeypatch) -> list[tuple[str, int, int]]:
    """Every header read over SFTP: (path, bytes asked for, bytes returned)."""
    reads: list[tuple[str, int, int]] = []
    original = SSHTransport.read_head

    async def counting(self, remote_path: str, nbytes: int) -> bytes:
        data = await original(self, remote_path, nbytes)
        reads.append((remote_path, nbytes, len(data)))
        return data

    monkeypatch.setattr(SSHTransport, "read_head", counting)
    return reads


def register(client, node, path: str | Path, name: str = "tiny"):
    return client.post(reverse("modelfiles:register"), {"name": name, "node": node.pk, "path": str(path)})


def errors_of(response) -> str:
    return html.unescape(response.content.decode())


@pytest.mark.lab
def test_a_model_on_a_lab_host_is_registered_from_its_header_over_sftp(
    lab, lab_host, operator_client, sftp_reads, tmp_path
):
    path = write_tiny_llama(tmp_path / "remote.gguf", TinyLlama())
    node = lab_node(lab, lab_host)
    response = register(operator_client, node, path)
    assert response.status_code == 302, errors_of(response)[:3000]

    model = ModelFile.objects.get(name="tiny")
    assert (model.node, model.path, model.shard_paths) == (node, str(path), [str(path)])
    assert model.size_bytes == path.stat().st_size
    local = gguf_profile.profile_path(path)
    del local["shard_paths"]
    assert model.profile == local
    assert model.profile["block_count"] == 8 and model.profile["head_count_kv"] == [2] * 8
    # Only the header travelled: one read of the first bytes, a small part of the file.
    assert [(p, asked) for p, asked, _ in sftp_reads] == [(str(path), HEAD_FIRST_READ)]
    assert sum(got for *_, got in sftp_reads) * 20 < path.stat().st_size
    event = AuditEvent.objects.get(action="model.register")
    assert event.changes["node"] == node.name and event.changes["path"] == str(path)


@pytest.mark.lab
def test_a_split_model_on_a_lab_host_finds_its_other_shard_beside_the_first(
    lab, lab_host, operator_client, sftp_reads, tmp_path
):
    first = write_tiny_llama(tmp_path / "split.gguf", TinyLlama(shards=2))
    second = first.with_name("split-00002-of-00002.gguf")
    node = lab_node(lab, lab_host)
    response = register(operator_client, node, first, name="split")
    assert response.status_code == 302, errors_of(response)[:3000]

    model = ModelFile.objects.get(name="split")
    assert model.shard_paths == [str(first), str(second)]
    assert model.size_bytes == first.stat().st_size + second.stat().st_size
    assert model.profile["split_count"] == 2
    assert model.profile["shards"] == [first.name, second.name]
    assert model.profile["weights_total_bytes"] == gguf_profile.profile_path(first)["weights_total_bytes"]
    assert sorted(p for p, *_ in sftp_reads) == sorted([str(first), str(second)])
    assert sum(got for *_, got in sftp_reads) * 10 < model.size_bytes


def _bad_files(tmp_path: Path) -> list[tuple[str, Path, str]]:
    """(what, path, the message the operator must see) for every kind of bad file."""
    good = write_tiny_llama(tmp_path / "good.gguf", TinyLlama())
    data = good.read_bytes()
    notes = tmp_path / "notes.gguf"
    notes.write_text("shopping list: milk, eggs")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:3000])
    future = tmp_path / "future.gguf"
    future.write_bytes(data[:4] + struct.pack("<I", 7) + data[8:])
    split = write_tiny_llama(tmp_path / "half.gguf", TinyLlama(shards=2))
    split.with_name("half-00002-of-00002.gguf").unlink()
    odd = write_tiny_llama(tmp_path / "odd.gguf", TinyLlama(shards=2))
    odd.with_name("odd-00002-of-00002.gguf").write_text("not a shard at all")
    hostile = tmp_path / "blocks.gguf"
    hostile.write_bytes(HOSTILE_BLOCKS)
    beyond = tmp_path / "beyond.gguf"
    beyond.write_bytes(data[: gguf_profile.read_header_path(good).data_offset + 4096])
    return [
        ("hostile block count", hostile, BLOCKS_MESSAGE),
        ("tensor beyond the end", beyond, "lies beyond the end of the file: its data would end at byte"),
        ("not GGUF", notes, "This is not a GGUF file: it begins with “shop”, a GGUF file with GGUF."),
        ("truncated", cut, "The GGUF header is cut short at byte 3000"),
        ("version", future, "GGUF version 7 is not supported (supported: 2 and 3)."),
        ("missing shard", split, "1 shard is missing beside it: half-00002-of-00002.gguf"),
        ("bad shard", odd, "Shard 2 of 2 (odd-00002-of-00002.gguf): This is not a GGUF file"),
        ("absent", tmp_path / "absent.gguf", f"No such file: {tmp_path / 'absent.gguf'}"),
        ("directory", tmp_path, f"{tmp_path} is not a regular file"),
    ]


@pytest.mark.lab
def test_bad_files_on_a_lab_host_are_refused_with_the_reason_and_nothing_is_registered(
    lab, lab_host, operator_client, tmp_path
):
    node = lab_node(lab, lab_host)
    for what, path, message in _bad_files(tmp_path):
        response = register(operator_client, node, path, name=f"bad {what}")
        page = errors_of(response)
        assert response.status_code == 400, what
        assert message in page, f"{what}: {page[page.find('errorlist') - 200 :][:800]}"
        # The form comes back with what was typed, ready to correct.
        assert str(path) in page, what
    assert not ModelFile.objects.exists()
    assert not AuditEvent.objects.filter(action="model.register").exists()


@pytest.mark.lab
def test_an_unreachable_node_is_reported_on_the_form_within_the_connect_timeout(
    lab, lab_host, operator_client, tmp_path
):
    path = write_tiny_llama(tmp_path / "remote.gguf", TinyLlama())
    node = lab_node(lab, lab_host)
    lab.stop_sshd(lab_host)
    response = register(operator_client, node, path)
    assert response.status_code == 400
    assert f"Could not read the file on {node.name}" in errors_of(response)
    assert not ModelFile.objects.exists()


def _big_header_gguf(path: Path, n_strings: int) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.strings", [f"piece-{i:08d}" for i in range(n_strings)])
    writer.add_tensor("t", np.zeros(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_header_larger_than_the_first_read_is_read_in_growing_pieces(tmp_path, monkeypatch):
    # About 900 KB of key/value data: more than the first read (256 KiB), less than the second (1 MiB).
    path = _big_header_gguf(tmp_path / "big.gguf", 40_000)
    asked: list[int] = []
    original = LocalTransport.read_head

    async def counting(self, remote_path: str, nbytes: int) -> bytes:
        asked.append(nbytes)
        return await original(self, remote_path, nbytes)

    monkeypatch.setattr(LocalTransport, "read_head", counting)

    async def read() -> dict[str, int]:
        async with gguf_isolated.HeaderReader() as reader:
            return await read_header(LocalTransport(), str(path), reader, file_size=path.stat().st_size)

    header = async_to_sync(read)()
    assert header["tensor_count"] == 1 and header["split_count"] == 1
    assert asked == [HEAD_FIRST_READ, HEAD_FIRST_READ * 4]
    assert HEAD_FIRST_READ < header["data_offset"] < HEAD_FIRST_READ * 4
    # Long arrays are kept as their length only.
    fields = gguf_profile.read_header_path(path).fields
    assert fields["test.strings"] == {"array_length": 40_000}
