"""Copying a model to a worker once: the form on the node page (operators, audited), the `model_copy` job over
real SFTP between two lab hosts (progress, resume from a partial file, SHA-256 checked on the destination, a
whole copy already there registered without sending), the tensors hashed for the RPC cache fill, and the node
page showing the copy, what it pays and the models whose tensors the node's cache holds."""

from __future__ import annotations

import asyncio
import hashlib
import html
from pathlib import Path

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs.models import Job, JobState
from llamacpp import gguf as gguf_profile
from llamacpp import tensor_cache
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles import cache_fill, local_copy
from modelfiles.models import ModelCopy, ModelFile
from nodes import cache
from remote.local import LocalTransport
from tests.deploy_fixtures import StepContext, lab_node, log_text, run
from tests.factories import NodeFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def private_channels(channel_layer):
    return channel_layer


@pytest.fixture
def small_threshold(monkeypatch):
    # The generated model's matrices are 128 to 320 KiB: all above this are "cacheable" here.
    monkeypatch.setattr(tensor_cache, "HASH_THRESHOLD", 64 * 1024)
    monkeypatch.setattr(local_copy, "CHUNK", 256 * 1024)  # several progress steps for a small file


def _model(node, path: Path) -> ModelFile:
    return ModelFile.objects.create(
        name="tiny",
        node=node,
        path=str(path),
        size_bytes=path.stat().st_size,
        profile={"architecture": "llama"},
    )


def _copy(client, model, node, path: str = "") -> Job:
    response = client.post(reverse("modelfiles:copy"), {"model": model.pk, "node": node.pk, "path": path})
    assert response.status_code == 302, response
    job = Job.objects.filter(kind="model_copy", node=node).latest("pk")
    assert response["Location"] == job.get_absolute_url()
    return job


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.lab
def test_a_copy_resumes_from_its_partial_file_and_is_checked_on_the_worker(
    lab, lab_hosts, operator_client, settings, tmp_path, small_threshold
):
    source_host, worker_host = lab_hosts(2)
    source, worker = lab_node(lab, source_host, name="desk"), lab_node(lab, worker_host, name="old-pc")
    (tmp_path / "models").mkdir()
    path = write_tiny_llama(tmp_path / "models" / "tiny.gguf", TinyLlama(n_layer=4))
    model = _model(source, path)
    dest = tmp_path / "on-worker" / "tiny.gguf"
    # An earlier copy stopped after its first MiB.
    dest.parent.mkdir()
    Path(f"{dest}.part").write_bytes(path.read_bytes()[: 2**20])
    job = run(_copy(operator_client, model, worker, str(dest)))
    assert job.state == JobState.SUCCEEDED, log_text(job)
    log = log_text(job)
    assert "Resuming the copy at 1.0 of" in log and "Copied" in log and "(100%" in log, log
    assert dest.read_bytes() == path.read_bytes() and not Path(f"{dest}.part").exists()
    copy = ModelCopy.objects.get(model=model, node=worker)
    assert (copy.path, copy.size_bytes, copy.sha256) == (str(dest), path.stat().st_size, _sha(path))
    model.refresh_from_db()
    assert model.sha256 == _sha(path)  # computed on the model's own node, kept
    assert tensor_cache.valid(model.tensor_hashes) and len(model.tensor_hashes["tensors"]) >= 12
    # The job ends by filling the worker's RPC cache with the whole model from the copy it just checked.
    worker.refresh_from_db()
    filled = sorted(p.name for p in (Path(worker.llama_cache_dir) / "rpc").iterdir())
    assert filled == sorted(e["fnv"] for e in model.tensor_hashes["tensors"]), log
    assert "its RPC cache is filled from it" in job.result
    assert AuditEvent.objects.filter(action="model.copy").count() == 1
    assert AuditEvent.objects.filter(action="model.copy.registered").count() == 1

    # The node page shows the copy; once its cache holds some of the model's tensors, the model too.
    worker.rpc_cache_state = {
        "bytes": 1,
        "entries": 2,
        "names": [e["fnv"] for e in model.tensor_hashes["tensors"][:2]],
    }
    worker.save()
    page = operator_client.get(worker.get_absolute_url()).content.decode()
    assert str(dest) in page and "deployments fill the RPC cache from it" in page
    total = len(model.tensor_hashes["tensors"])
    assert f"tiny: 2 of {total} cacheable tensors" in page


@pytest.mark.lab
def test_a_whole_copy_already_there_is_registered_and_a_bad_one_is_removed(
    lab, lab_hosts, operator_client, settings, tmp_path, small_threshold
):
    source_host, worker_host = lab_hosts(2)
    source, worker = lab_node(lab, source_host, name="desk"), lab_node(lab, worker_host, name="old-pc")
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama(n_layer=2))
    model = _model(source, path)
    # The same file on the worker already (a shared folder, a copy by hand): nothing is sent.
    there = tmp_path / "shared" / "tiny.gguf"
    there.parent.mkdir()
    there.write_bytes(path.read_bytes())
    job = run(_copy(operator_client, model, worker, str(there)))
    assert job.state == JobState.SUCCEEDED, log_text(job)
    assert "already holds tiny (size and SHA-256 checked)" in log_text(job) and "Copied" not in log_text(job)
    assert ModelCopy.objects.get(model=model, node=worker).path == str(there)

    # A partial file that is not the model's beginning: the finished copy fails its SHA-256, and is removed.
    ModelCopy.objects.all().delete()
    other = tmp_path / "elsewhere" / "tiny.gguf"
    other.parent.mkdir()
    Path(f"{other}.part").write_bytes(b"\0" * 4096)
    failed = run(_copy(operator_client, model, worker, str(other)))
    assert failed.state == JobState.FAILED and "SHA-256" in failed.result, log_text(failed)
    assert not Path(f"{other}.part").exists() and not other.exists()
    assert not ModelCopy.objects.exists()

    # A different file at the destination is never overwritten.
    other.write_bytes(b"not a model")
    refused = run(_copy(operator_client, model, worker, str(other)))
    assert refused.state == JobState.FAILED and "is not tiny" in refused.result
    assert other.read_bytes() == b"not a model"


def _split_model(node, folder: Path, shards: int = 3) -> ModelFile:
    first = write_tiny_llama(folder / "tiny.gguf", TinyLlama(n_layer=4, shards=shards))
    paths = gguf_profile.shard_paths(str(first), shards)
    return ModelFile.objects.create(
        name="tiny",
        node=node,
        path=str(first),
        shard_paths=paths,
        size_bytes=sum(Path(p).stat().st_size for p in paths),
        profile={"architecture": "llama"},
    )


def _cut(entry: dict, shards: list[str]) -> bytes:
    data = Path(shards[entry["shard"]]).read_bytes()
    return data[entry["offset"] : entry["offset"] + entry["size"]]


@pytest.mark.lab
def test_a_split_model_is_copied_shard_by_shard_resumed_checked_and_fills_the_cache(
    lab, lab_hosts, operator_client, settings, tmp_path, small_threshold
):
    source_host, worker_host = lab_hosts(2)
    source, worker = lab_node(lab, source_host, name="desk"), lab_node(lab, worker_host, name="old-pc")
    (tmp_path / "models").mkdir()
    model = _split_model(source, tmp_path / "models", shards=3)
    shards = [Path(p) for p in model.shard_paths]
    assert [p.name for p in shards] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    dest = tmp_path / "on-worker" / shards[0].name
    dest.parent.mkdir()
    # The first shard is there whole already (copied by hand), an earlier copy stopped inside the second,
    # the third was never started.
    dest.write_bytes(shards[0].read_bytes())
    second = dest.with_name(shards[1].name)
    Path(f"{second}.part").write_bytes(shards[1].read_bytes()[: 2**20])
    job = run(_copy(operator_client, model, worker, str(dest)))
    log = log_text(job)
    assert job.state == JobState.SUCCEEDED, log
    assert "Computing the SHA-256 of the 3 shards of tiny on desk" in log
    assert f"{dest} on old-pc already holds shard 1 of 3 of tiny (size and SHA-256 checked)." in log
    assert "Resuming shard 2 of 3 at 1.0 of" in log and "(2 of 3 shards)" in log and "(100%" in log, log
    assert "Checking the SHA-256 of shard 1 of 3" not in log and "Checking the SHA-256 of shard 3 of 3" in log
    # Every shard beside the first under its own name, byte for byte; no part left.
    for shard in shards:
        assert (dest.parent / shard.name).read_bytes() == shard.read_bytes(), shard.name
    assert sorted(p.name for p in dest.parent.iterdir()) == sorted(p.name for p in shards)
    copy = ModelCopy.objects.get(model=model, node=worker)
    assert (copy.path, copy.size_bytes, copy.sha256) == (str(dest), model.size_bytes, _sha(shards[0]))
    model.refresh_from_db()
    assert model.shard_sha256 == [_sha(p) for p in shards] and model.sha256 == _sha(shards[0])
    # The hashes say which shard holds each tensor; every shard holds some.
    entries = model.tensor_hashes["tensors"]
    assert tensor_cache.valid(model.tensor_hashes, shards=3) and {e["shard"] for e in entries} == {0, 1, 2}
    # The cache is filled with the whole model, each tensor cut out of its own shard's copy.
    worker.refresh_from_db()
    rpc = Path(worker.llama_cache_dir) / "rpc"
    assert sorted(p.name for p in rpc.iterdir()) == sorted(e["fnv"] for e in entries), log
    copies = [str(dest.parent / p.name) for p in shards]
    for entry in entries:
        assert (rpc / entry["fnv"]).read_bytes() == _cut(entry, copies), entry["name"]
    assert f"Filling the RPC cache from {dest} and the 2 shards beside it" in log

    # Again, every shard there whole: nothing is sent, no SHA-256 computed again on the model's node.
    ModelCopy.objects.all().delete()
    again = run(_copy(operator_client, model, worker, str(dest)))
    assert again.state == JobState.SUCCEEDED, log_text(again)
    assert "Copied" not in log_text(again) and "Computing" not in log_text(again)
    assert log_text(again).count("(size and SHA-256 checked)") == 3

    # Elsewhere, a part of the third shard that is not its bytes: the first two are placed, the third fails
    # its SHA-256 and its part is removed; a new copy then sends only that one.
    ModelCopy.objects.all().delete()
    other = tmp_path / "elsewhere" / shards[0].name
    other.parent.mkdir()
    Path(f"{other.with_name(shards[2].name)}.part").write_bytes(b"\0" * shards[2].stat().st_size)
    failed = run(_copy(operator_client, model, worker, str(other)))
    assert failed.state == JobState.FAILED and "The SHA-256 of shard 3 of 3 is" in failed.result, log_text(
        failed
    )
    assert sorted(p.name for p in other.parent.iterdir()) == [shards[0].name, shards[1].name]
    assert not ModelCopy.objects.exists()
    redone = run(_copy(operator_client, model, worker, str(other)))
    assert redone.state == JobState.SUCCEEDED, log_text(redone)
    assert "(1 of 3 shards)" in log_text(redone)
    assert other.with_name(shards[2].name).read_bytes() == shards[2].read_bytes()


@pytest.mark.django_db
def test_a_viewer_cannot_copy_a_model(viewer_client):
    source, worker = NodeFactory(name="desk"), NodeFactory(name="old-pc")
    model = ModelFile.objects.create(name="m", node=source, path="/models/m.gguf", size_bytes=10, profile={})
    assert (
        viewer_client.post(reverse("modelfiles:copy"), {"model": model.pk, "node": worker.pk}).status_code
        == 403
    )
    assert "Copy a model here" not in viewer_client.get(worker.get_absolute_url()).content.decode()
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_the_copy_form_refuses_bad_paths_misnamed_shards_and_the_models_own_node(operator_client):
    source, worker = NodeFactory(name="desk"), NodeFactory(name="old-pc")
    model = ModelFile.objects.create(name="m", node=source, path="/models/m.gguf", size_bytes=10, profile={})
    url = reverse("modelfiles:copy")
    for path, why in (
        ("relative/m.gguf", "absolute path"),
        ("/data/../etc/m.gguf", "without '..'"),
        ("/data/m.bin", ".gguf"),
    ):
        response = operator_client.post(
            url, {"model": model.pk, "node": worker.pk, "path": path}, follow=True
        )
        assert why in html.unescape(response.content.decode()), path
    response = operator_client.post(url, {"model": model.pk, "node": source.pk}, follow=True)
    assert "lives on desk already" in response.content.decode()
    # A split model's destination names its first shard, so that llama.cpp finds the others beside it.
    split = ModelFile.objects.create(
        name="big", node=source, path="/models/big-00001-of-00002.gguf", shard_paths=["a", "b"], profile={}
    )
    for path in ("/data/big.gguf", "/data/big-00001-of-00003.gguf", "/data/big-00002-of-00002.gguf"):
        response = operator_client.post(
            url, {"model": split.pk, "node": worker.pk, "path": path}, follow=True
        )
        assert "big is split into 2 files: the destination must name its first shard, " in html.unescape(
            response.content.decode()
        ), path
    assert not Job.objects.filter(kind="model_copy").exists()
    # The node page offers the copy, with what it costs against streaming.
    page = operator_client.get(worker.get_absolute_url()).content.decode()
    assert "Copy a model here" in page and "Copy to old-pc" in page and "a copy sends" in page


def _model_with_nodes_around() -> tuple[ModelFile, dict]:
    """A 3 GB model on desk whose one plan gave old-pc a third of it; attic holds a copy already, win runs
    Windows, off is disabled."""
    from deployments.models import Deployment

    nodes = {name: NodeFactory(name=name) for name in ("desk", "old-pc", "attic", "win", "off")}
    nodes["win"].platform_hint = "windows"
    nodes["off"].enabled = False
    for node in (nodes["win"], nodes["off"]):
        node.save()
    model = ModelFile.objects.create(
        name="m", node=nodes["desk"], path="/models/m.gguf", size_bytes=3 * 10**9, profile={}
    )
    ModelCopy.objects.create(
        model=model, node=nodes["attic"], path="/srv/copies/m.gguf", size_bytes=3 * 10**9, sha256="0" * 64
    )
    placement = {"node": "old-pc", "endpoint": "10.0.0.2:50052", "weights_bytes": 10**9}
    Deployment.objects.create(
        name="d", model_file=model, coordinator=nodes["desk"], plan={"placements": [placement]}, port=8080
    )
    return model, nodes


@pytest.mark.django_db
def test_the_model_page_offers_an_operator_a_copy_to_each_node_that_can_take_one(operator_client):
    model, _ = _model_with_nodes_around()
    page = html.unescape(operator_client.get(reverse("modelfiles:detail", args=[model.pk])).content.decode())
    assert "Copy to a node" in page and "Copy to old-pc" in page
    # The figure the node page shows, from the same function: old-pc was sent a third of the file.
    assert "a copy sends 2.8 GiB once, worth it after 3 cold starts" in page, page
    # Not the model's own node, a node holding a copy, a Windows node nor a disabled one.
    for name in ("desk", "attic", "win", "off"):
        assert f"Copy to {name}" not in page, name
    assert f'name="next" value="{model.get_absolute_url()}"' in page
    # The copies made are listed, with where they are and when they were checked.
    copies = page.split('id="model-copies"')[1].split('id="copy-model"')[0]
    assert "attic" in copies and "/srv/copies/m.gguf" in copies and "SHA-256 checked there" in copies
    # The models list leads to the page.
    assert model.get_absolute_url() in operator_client.get(reverse("modelfiles:list")).content.decode()


@pytest.mark.django_db
def test_a_viewer_sees_a_models_copies_but_no_copy_form(viewer_client):
    model, _ = _model_with_nodes_around()
    page = viewer_client.get(reverse("modelfiles:detail", args=[model.pk])).content.decode()
    assert "/srv/copies/m.gguf" in page
    assert "Copy to a node" not in page and reverse("modelfiles:copy") not in page


@pytest.mark.django_db
def test_a_split_models_page_offers_its_copy_shard_by_shard(operator_client):
    source, worker = NodeFactory(name="desk"), NodeFactory(name="old-pc")
    split = ModelFile.objects.create(
        name="big",
        node=source,
        path="/models/big-00001-of-00002.gguf",
        shard_paths=["/models/big-00001-of-00002.gguf", "/models/big-00002-of-00002.gguf"],
        shard_sha256=["a" * 64, "b" * 64],
        sha256="a" * 64,
        size_bytes=2 * 10**9,
        profile={},
    )
    page = html.unescape(operator_client.get(reverse("modelfiles:detail", args=[split.pk])).content.decode())
    assert "not supported" not in page and "Copy to old-pc" in page
    assert "all 2 shards, the others beside the first under their own names" in page
    assert "a copy sends 1.9 GiB once" in page
    # Each shard's SHA-256, once computed, is on the page.
    assert "a" * 64 in page and "b" * 64 in page
    # The node page offers it too.
    node_page = operator_client.get(worker.get_absolute_url()).content.decode()
    assert "Copy to old-pc" in node_page and "big" in node_page


@pytest.mark.django_db
def test_a_copy_refused_on_the_model_page_comes_back_there_with_its_error(operator_client):
    model, nodes = _model_with_nodes_around()
    model_page, node_page = model.get_absolute_url(), nodes["old-pc"].get_absolute_url()
    url = reverse("modelfiles:copy")
    post = {"model": model.pk, "node": nodes["old-pc"].pk, "path": "relative/m.gguf"}
    response = operator_client.post(url, {**post, "next": model_page})
    assert (response.status_code, response["Location"]) == (302, model_page)
    page = html.unescape(operator_client.get(model_page).content.decode())
    assert "The model was not copied: The destination must be an absolute path" in page
    # The node page's form (no `next`) still goes back to the node page, and a `next` naming any page but
    # the model's or the node's is not followed.
    for elsewhere in (
        "",
        node_page,
        "https://evil.example/",
        "//evil.example/",
        reverse("audit"),
        "/models/99/",
    ):
        response = operator_client.post(url, {**post, "next": elsewhere})
        assert (response.status_code, response["Location"]) == (302, node_page), elsewhere
    assert not Job.objects.filter(kind="model_copy").exists()


@pytest.mark.django_db
def test_a_copy_posted_from_the_model_page_starts_its_job_and_the_page_shows_it(operator_client):
    model, nodes = _model_with_nodes_around()
    response = operator_client.post(
        reverse("modelfiles:copy"),
        {"model": model.pk, "node": nodes["old-pc"].pk, "path": "", "next": model.get_absolute_url()},
    )
    job = Job.objects.get(kind="model_copy", node=nodes["old-pc"])
    assert (response.status_code, response["Location"]) == (302, job.get_absolute_url())
    assert job.params == {"model": model.pk, "path": local_copy.default_destination(model)}
    assert AuditEvent.objects.filter(action="model.copy").count() == 1
    copies = operator_client.get(model.get_absolute_url()).content.decode().split('id="model-copies"')[1]
    assert f'href="{job.get_absolute_url()}">copy queued</a>' in copies.split('id="copy-model"')[0]


def _fill_deployment(worker, tmp_path, small):
    """A deployment whose plan gives `worker` blocks 1-2 of a generated model, the worker holding a copy."""
    from deployments.models import Deployment

    source = NodeFactory(name="desk")
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama(n_layer=4))
    model = _model(source, path)
    model.tensor_hashes = tensor_cache.hash_tensors(
        lambda off, n: path.read_bytes()[off : off + n], gguf_profile.read_header_path(path)
    )
    model.save()
    copy = tmp_path / "worker copy $(id).gguf"
    copy.write_bytes(path.read_bytes())
    ModelCopy.objects.create(
        model=model, node=worker, path=str(copy), size_bytes=path.stat().st_size, sha256="0" * 64
    )
    placement = {"node": worker.name, "endpoint": "10.0.0.2:50052", "first_layer": 1, "layers": 2}
    return (
        model,
        copy,
        Deployment.objects.create(
            name="d", model_file=model, coordinator=source, plan={"placements": [placement]}, port=8080
        ),
    )


@pytest.mark.django_db(transaction=True)
def test_the_fill_step_writes_the_workers_tensors_from_its_copy_and_counts_them(
    local_node, tmp_path, small_threshold
):
    local_node.llama_cache_dir = str(tmp_path / "cache")
    local_node.rpc_cache_state = {"bytes": 0, "entries": 0, "names": [], "free_bytes": 10**12}
    local_node.save()
    model, copy, deployment = _fill_deployment(local_node, tmp_path, small_threshold)
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_before_start(ctx, deployment))
    wanted = [e for e in model.tensor_hashes["tensors"] if e["name"].split(".")[1] in ("1", "2")]
    rpc = tmp_path / "cache" / "rpc"
    assert sorted(p.name for p in rpc.iterdir()) == sorted(e["fnv"] for e in wanted), ctx.lines
    assert any(f"{len(wanted)} tensors written" in line for line in ctx.lines), ctx.lines
    local_node.refresh_from_db()
    assert sorted(local_node.rpc_cache_state["names"]) == sorted(e["fnv"] for e in wanted)
    assert local_node.rpc_cache_state["bytes"] == sum(e["size"] for e in wanted)

    # A copy whose size changed since it was checked fills nothing, and says so.
    for entry in rpc.iterdir():
        entry.unlink()
    copy.write_bytes(copy.read_bytes()[:-1])
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_before_start(ctx, deployment))
    assert not list(rpc.iterdir()) and any("is not filled from it" in line for line in ctx.lines), ctx.lines

    # Too little free disk for the tensors: nothing is filled (they cross the network as always).
    copy.write_bytes(Path(model.path).read_bytes())
    local_node.rpc_cache_state = {**local_node.rpc_cache_state, "free_bytes": 1000}
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_before_start(ctx, deployment))
    assert not list(rpc.iterdir()) and any("MiB free on the cache's disk" in line for line in ctx.lines)


@pytest.mark.django_db(transaction=True)
def test_a_registered_copy_fills_the_whole_model_into_the_cache_when_it_fits_the_limit(
    local_node, tmp_path, small_threshold
):
    """The copy job's last step: every cacheable tensor of the model into the node's cache, so the first
    deployment loads as a warm one; then a deployment's own fill finds them there and writes nothing."""
    local_node.llama_cache_dir = str(tmp_path / "cache")
    local_node.rpc_cache_limit_gib = 1
    local_node.save()
    model, copy, deployment = _fill_deployment(local_node, tmp_path, small_threshold)
    registered = ModelCopy.objects.get(model=model, node=local_node)
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_after_copy(ctx, model, registered))
    every = model.tensor_hashes["tensors"]
    rpc = tmp_path / "cache" / "rpc"
    assert sorted(p.name for p in rpc.iterdir()) == sorted(e["fnv"] for e in every), ctx.lines
    assert any(
        f"{len(every)} tensors written" in line and "the whole model" not in line for line in ctx.lines
    )
    assert any("of the whole model" in line for line in ctx.lines), ctx.lines
    for entry in every:
        data = Path(model.path).read_bytes()[entry["offset"] : entry["offset"] + entry["size"]]
        assert (rpc / entry["fnv"]).read_bytes() == data
    local_node.refresh_from_db()
    assert local_node.rpc_cache_state["bytes"] == sum(e["size"] for e in every)

    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_before_start(ctx, deployment))
    planned = [e for e in every if e["name"].split(".")[1] in ("1", "2")]
    assert any(f"0 tensors written (0.0 MiB), {len(planned)} there already" in line for line in ctx.lines)


@pytest.mark.django_db(transaction=True)
def test_a_split_models_copy_fills_each_tensor_from_its_own_shard(local_node, tmp_path, small_threshold):
    local_node.llama_cache_dir = str(tmp_path / "cache")
    local_node.rpc_cache_limit_gib = 1
    local_node.save()
    (tmp_path / "models").mkdir()
    model = _split_model(NodeFactory(name="desk"), tmp_path / "models", shards=2)
    model.tensor_hashes = tensor_cache.hash_shards(
        [
            ((lambda off, n, p=p: Path(p).read_bytes()[off : off + n]), gguf_profile.read_header_path(p))
            for p in model.shard_paths
        ]
    )
    model.save()
    copies = tmp_path / "worker $(id) copy"
    copies.mkdir()
    for shard in model.shard_paths:
        (copies / Path(shard).name).write_bytes(Path(shard).read_bytes())
    first = copies / Path(model.path).name
    copy = ModelCopy.objects.create(
        model=model, node=local_node, path=str(first), size_bytes=model.size_bytes, sha256="0" * 64
    )
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_after_copy(ctx, model, copy))
    every = model.tensor_hashes["tensors"]
    rpc = tmp_path / "cache" / "rpc"
    assert sorted(p.name for p in rpc.iterdir()) == sorted(e["fnv"] for e in every), ctx.lines
    for entry in every:
        assert (rpc / entry["fnv"]).read_bytes() == _cut(entry, model.shard_paths)

    # A shard of the copy gone: nothing is filled, and the log says why.
    for entry in rpc.iterdir():
        entry.unlink()
    (copies / Path(model.shard_paths[1]).name).unlink()
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_after_copy(ctx, model, copy))
    assert not list(rpc.iterdir()), ctx.lines
    assert any("(2 shards) is" in line and "missing now" in line for line in ctx.lines), ctx.lines


@pytest.mark.django_db(transaction=True)
def test_a_copy_larger_than_the_cache_limit_leaves_the_fill_to_each_deployment(
    local_node, tmp_path, small_threshold, monkeypatch
):
    local_node.llama_cache_dir = str(tmp_path / "cache")
    local_node.rpc_cache_limit_gib = 1
    local_node.save()
    monkeypatch.setattr(cache, "limit_bytes", lambda node: 64 * 1024)  # less than the model's tensors
    model, _copy_path, _deployment = _fill_deployment(local_node, tmp_path, small_threshold)
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_after_copy(ctx, model, ModelCopy.objects.get(model=model, node=local_node)))
    assert not list((tmp_path / "cache" / "rpc").glob("*")), ctx.lines
    assert any("each deployment fills the tensors of its own blocks instead" in line for line in ctx.lines)

    # A node whose cache is turned off (limit 0) is not filled at all, nor read.
    local_node.rpc_cache_limit_gib = 0
    ctx = StepContext({}, node=local_node, transport=LocalTransport())
    asyncio.run(cache_fill.fill_after_copy(ctx, model, ModelCopy.objects.get(model=model, node=local_node)))
    assert ctx.lines == []
