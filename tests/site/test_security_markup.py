"""Text from a node or a GGUF file never becomes markup (issue 17's high finding and its lows on text).

An operator's command job can put a fake `nvidia-smi` on a node's PATH that prints a GPU "name" such as
`<i hx-post=/users/new/ hx-trigger=load></i><input name=username value=eve><input name=role value=admin>`;
a GGUF file's author writes its general.name; llama.cpp's banners and logs are whatever the binary on the node
prints. Three layers keep that text text:

- every template escapes it: no `|safe` on anything not built as safe HTML in code, which the first test
  proves by putting the payload into every field a node or a GGUF file can fill, straight into the database
  (past the cleaning), and fetching every GET page of the role matrix (tests/site/test_security_roles.py's
  routes) as an admin;
- what enters the database is cleaned (remote/text.py): no control, bidi or other format
  characters, cut to the field; the other tests go through each entry point;
- the regions that show such text carry `hx-disable` (tests/site/test_security_markup_browser.py opens the
  speed-figures page in Chromium and watches for requests).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit import history
from audit.models import AuditEvent
from builds.models import Build, BuildSource
from calibration.store import store
from deployments import monitor
from deployments.models import Deployment, DeploymentState, DeploymentStep, StaleProcess
from jobs.models import Job, JobState
from llamacpp.reaper import Holder
from modelfiles.download import _create_model
from modelfiles.models import ModelFile
from nodes.models import Device, DeviceKind, Node, Reachability, Transport
from nodes.probe import parse as probe
from nodes.probe.collect import FACT_LIMITS, apply_probe_report, record_probe_failure
from remote.text import ELLIPSIS, printable, printable_json
from tests.deploy_fixtures import log_text, run
from tests.factories import DeviceFactory, NodeFactory, UserFactory
from tests.paths import DATA as TEST_DATA
from tests.site.routes import HTTP_ROUTES, url_of

pytestmark = pytest.mark.security

PROBE_DATA = TEST_DATA / "probe"

# The finding's payload: htmx would post the admin's session and CSRF header to /users/new/ on load.
HTMX = (
    "<i hx-post=/users/new/ hx-trigger=load{tag}></i><input name=username value=eve>"
    "<input name=role value=admin>"
)
SCRIPT = "<script{tag}>alert(1)</script>"
# The same behind a right-to-left override and an isolate (U+202E, U+2066..U+2069).
BIDI = "\u202e<i hx-get=/users/ hx-trigger=load{tag}>\u2066gpu\u2069</i>"
# What must never appear in a page unescaped.
RAW_MARKERS = ("<i hx-post", "<i hx-get", "<script data-f", "<input name=username", "<input name=role")
# Controls, bidi and other format characters, C1, a terminal sequence, line separators; then a long tail.
NASTY = "\u202e\u2066\u2069\u200e\u200f\u200b\ufeff\u00ad\x00\x07\x08\x1b[31m\x7f\x85\x9b\u2028\u2029\r"
HOSTILE = HTMX.format(tag="") + NASTY + "A" * 5000


def payload(tag: str, limit: int | None = None) -> str:
    """Each variant, marked with `data-f=TAG` so a page that shows the field can be told apart. Cut to
    `limit` for a short field (the htmx variant comes first and survives a cut at 100)."""
    mark = f" data-f={tag}"
    text = HTMX.format(tag=mark) + SCRIPT.format(tag=mark) + BIDI.format(tag=mark)
    return text[:limit] if limit else text


def short(tag: str) -> str:
    """For fields of 40 characters: the start of the htmx variant and the tag."""
    return f"<i hx-post=/u/ data-f={tag}>"


# --- 1. Straight into the database: every page escapes ----------------------------------------------------


def _report_facts(tag_prefix: str) -> dict:
    """Every fact the probe stores, each a payload (strings) or a payload path (binaries)."""
    facts = {key: payload(f"{tag_prefix}{key}") for key, value in probe.ProbeReport().facts().items()
             if isinstance(value, str)}  # fmt: skip
    folder = f"/opt/{payload(f'{tag_prefix}dir', 120)}"
    facts |= {
        "rpc_server_binary": f"{folder}/ggml-rpc-server",
        "llama_server_binary": f"{folder}/llama-server",
        "binaries": {"llama-server": f"{folder}/llama-server", payload(f"{tag_prefix}binkey", 60): "/x"},
        "warnings": [payload(f"{tag_prefix}warning")],
        "rpc_port_in_use": True,
        "rpc_port_pid": 4242,
        "cpu_cores": 8,
        "ram_total_bytes": 2**34,
        "ram_available_bytes": 2**33,
    }
    return facts


def _fill_with_payloads(data: dict) -> None:
    """Every field a node (through the probe, builds, logs, the monitor) or a GGUF file can fill, with the
    payload, written with .update()/create() so nothing cleans it first."""
    attic, model, deployment, job = data["node"], data["model"], data["deployment"], data["job"]
    # The node: reachable enough to show its hardware and its last error, no pending key in the way.
    Node.objects.filter(pk=attic.pk).update(
        facts=_report_facts("fact-"),
        last_error=payload("last-error"),
        reachability=Reachability.UNREACHABLE,
        pending_host_key="",
        pending_host_key_fingerprint="",
        last_seen_at=timezone.now(),
        calibration={"link": {"protocol": payload("calibration")}},
    )
    Device.objects.create(node=attic, name=short("dev-name"), kind=DeviceKind.CUDA, description=payload(
        "dev-desc", 200), total_bytes=2**34, free_bytes=2**33, bandwidth_gbs=900.0,
        measured_signature=payload("dev-signature", 400))  # fmt: skip
    DeviceFactory(node=attic, name="CPU", description=payload("cpu-desc", 200))
    Build.objects.create(
        node=attic,
        source_kind=BuildSource.EXISTING,
        source=payload("build-source"),
        version=payload("build-version", 200),
        rpc_binary=short("build-rpcbin"),
        rpc_protocol="<i hx-post=/u/>7",
        build_dir=payload("build-dir"),
        rpc_server_path=payload("build-rpc-path"),
        llama_server_path=payload("build-llama-path"),
    )
    # The model: its name from general.name, its profile's strings from the header.
    profile = dict(model.profile)
    profile |= {key: payload(f"profile-{key}") for key in ("name", "architecture", "file_type_name")}
    profile["shards"] = [payload("profile-shard")]
    ModelFile.objects.filter(pk=model.pk).update(name=payload("model-name", 200), profile=profile)
    # The deployment: named after the model; degraded, with what llama.cpp and the monitor said.
    verification = {
        "devices": {payload("verify-key", 80): {"node": payload("verify-node"), "layers": 3, "checked": True,
                                                "ok": False}},
        "problems": [payload("verify-problem")],
        "lines": [payload("verify-line")],
        "context": {"total": 512},
    }  # fmt: skip
    live_status = {
        "checked_at": timezone.now().isoformat(),
        "processes": [{"node": payload("live-node"), "role": payload("live-role"), "pid": 1, "port": 2,
                       "alive": False, "error": payload("live-error"), "log": payload("live-log")}],
        # Stored, but never shown: the page says in sentences what the numbers it knows mean.
        "metrics": {payload("metric-name", 100): payload("metric-value")},
    }  # fmt: skip
    Deployment.objects.filter(pk=deployment.pk).update(
        name=payload("deployment-name", 200),
        state=DeploymentState.DEGRADED,
        state_reason=payload("state-reason"),
        verification=verification,
        live_status=live_status,
    )
    # A job that is a step of it, with what the node printed.
    Job.objects.filter(pk=job.pk).update(
        title=payload("job-title", 200), result=payload("job-result", 500), node=attic, node_name=attic.name
    )
    job.append_lines([("out", payload("log-out")), ("err", payload("log-err"))])
    DeploymentStep.objects.create(deployment=deployment, job=job, name="verify", order=1)
    failed = Job.objects.create(kind="command", node=attic, title="failed", state=JobState.FAILED,
                                result=payload("failed-result", 500), finished_at=timezone.now())  # fmt: skip
    assert failed.pk
    StaleProcess.objects.filter(pk=data["stale"].pk).update(program=short("stale-program"),
                                                             cmdline=payload("stale-cmdline"))  # fmt: skip
    # Audit entries quoting a node (a degraded deployment's reason) and a model (its name).
    AuditEvent.objects.create(action="deployment.degraded", object_type="deployment",
                              object_id=str(deployment.pk), object_repr=payload("audit-repr", 200),
                              changes={"reason": payload("audit-reason")})  # fmt: skip


# Fields a page shows (others are stored for the console's own use, such as measured_signature).
SHOWN = {
    "fact-os_name",
    "fact-kernel",
    "fact-arch",
    "fact-cpu_model",
    "fact-llama_version",
    "fact-rpc_port_process",
    "fact-dir",
    "last-error",
    "dev-name",
    "dev-desc",
    "cpu-desc",
    "build-source",
    "build-version",
    "build-rpcbin",
    "build-rpc-path",
    "build-llama-path",
    "profile-architecture",
    "profile-file_type_name",
    "model-name",
    "verify-key",
    "verify-node",
    "verify-problem",
    "live-node",
    "live-role",
    "live-error",
    "live-log",
    "deployment-name",
    "state-reason",
    "job-title",
    "job-result",
    "log-out",
    "log-err",
    "failed-result",
    "stale-program",
    "stale-cmdline",
    "audit-reason",
}


def _extra_requests(data: dict) -> list[tuple[str, str, dict]]:
    """Fragments that GET pages fetch with htmx (the role matrix asks for the full pages)."""
    htmx = {"HX-Request": "true"}
    job, deployment = data["job"], data["deployment"]
    return [
        ("hardware fragment", reverse("nodes:hardware", args=[data["node"].name]), htmx),
        ("job poll", reverse("jobs:detail", args=[job.pk]) + "?after=-1", htmx),
        ("job earlier lines", reverse("jobs:detail", args=[job.pk]) + "?before=2", htmx),
        ("run region", reverse("deployments:run", args=[deployment.pk]),
         htmx | {"HX-Target": "deployment-run"}),
    ]  # fmt: skip


def test_node_and_gguf_text_is_escaped_on_every_page_even_when_stored_raw(db, world):
    _fill_with_payloads(world)
    users_before = get_user_model().objects.count()
    client = Client()
    client.force_login(world["users"]["admin"])
    requests = [(key, url_of(key, pattern, world), {}) for key, pattern in HTTP_ROUTES]
    seen_tags: set[str] = set()
    raw: list[str] = []
    pages = 0
    for name, url, headers in requests + _extra_requests(world):
        response = client.get(url, headers=headers)
        if response.status_code in (302, 404, 405):  # redirects, the admin's catch-all, POST-only routes
            continue
        assert response.status_code in (200, 403), f"{name}: {response.status_code}"
        body = (b"".join(response.streaming_content) if response.streaming else response.content).decode()
        kind = response.headers.get("Content-Type", "")
        if kind.startswith("text/plain"):
            # The log download is plain text: no markup to escape, but no sniffing into HTML either, and no
            # control or bidi character (issue 17, low).
            assert response.headers.get("X-Content-Type-Options") == "nosniff", name
            assert not [c for c in body if _forbidden(c, lines=True)], name
            continue
        pages += 1
        raw += [f"{name}: {marker!r}" for marker in RAW_MARKERS if marker in body]
        seen_tags.update(re.findall(r"data-f=([\w-]+)", body))
    assert pages >= 30, f"only {pages} pages were rendered"
    assert not raw, "Payloads reached a page unescaped:\n" + "\n".join(raw)
    missing = sorted(SHOWN - seen_tags)
    assert not missing, f"These fields were shown nowhere (the test would not notice them): {missing}"
    assert get_user_model().objects.count() == users_before


# --- 2. Cleaned where it enters the database ---------------------------------------------------------------


def _forbidden(char: str, *, lines: bool) -> bool:
    if lines and char in "\n\t":
        return False
    return unicodedata.category(char)[0] == "C" or unicodedata.category(char) in ("Zl", "Zp")


def assert_clean(value, limit: int | None = None, *, lines: bool = False, where: str = "") -> None:
    """Every string in `value` (JSON too): no control, bidi or format character, at most `limit` long."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert_clean(key, limit, where=f"{where}[key {key!r}]")
            assert_clean(item, limit, lines=lines, where=f"{where}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            assert_clean(item, limit, lines=lines, where=f"{where}[{index}]")
    elif isinstance(value, str):
        bad = sorted({f"U+{ord(c):04X}" for c in value if _forbidden(c, lines=lines)})
        assert not bad, f"{where}: {bad} in {value[:80]!r}"
        assert limit is None or len(value) <= limit, f"{where}: {len(value)} characters, more than {limit}"


def test_printable_removes_every_control_and_format_character_and_cuts_to_the_limit():
    every = "".join(chr(c) for c in range(0x110000) if unicodedata.category(chr(c))[0] == "C")
    assert (
        len(every) > 100_000
    )  # Cc, Cf, Cs, Co, Cn: controls, bidi and format, surrogates, private, unassigned
    assert printable(every, None).strip(" ") == ""  # line breaks and tabs become spaces, the rest goes
    assert printable(every, None, lines=True) == _kept(every)
    assert printable("a\u202eb\u2066c\u2069d\u200ee\u200ff\ufeffg", 100) == "abcdefg"
    assert printable("tab\there\nnew\u2028line\u00a0sp", 100) == "tab here new line sp"
    assert printable("tab\there\r\nnew\u2028line", 100, lines=True) == "tab\there\nnew\nline"
    assert printable("\x1b[1;31mred\x1b[0m \x1b]0;title\x07done", 100) == "red done"
    assert printable("x" * 300, 200) == "x" * 199 + ELLIPSIS
    assert printable(HOSTILE, 200).startswith(HTMX.format(tag="")) and len(printable(HOSTILE, 200)) == 200
    assert printable_json({"k\u202e": ["v\x00", 3, None, {"n": "\u2066x"}]}) == {
        "k": ["v", 3, None, {"n": "x"}]
    }


def _kept(text: str) -> str:
    """What multi-line mode keeps of `text`: newlines and tabs, and a newline for CR and the other breaks."""
    return "".join(
        "\n" if c in "\r\x0b\x0c\x1c\x1d\x1e\x85" else c
        for c in text
        if c in "\n\t\r\x0b\x0c\x1c\x1d\x1e\x85"
    )


def _hostile_probe_text() -> str:
    text = (PROBE_DATA / "linux_ubuntu_rtx3090.txt").read_text()
    # One line of the tool's output (the parsers split lines, as str.splitlines does at U+2028 and U+0085);
    # nvidia-smi's CSV: no comma either.
    gpu = (
        HTMX.format(tag="") + "\u202e\u2066\u2069\u200e\u200f\u200b\ufeff\x00\x07\x1b[31m\x7f\x9b" + "A" * 600
    )
    replacements = {
        "\ntower\n": f"\n{HOSTILE}\n",
        'PRETTY_NAME="Ubuntu 22.04.4 LTS"': f'PRETTY_NAME="{gpu}"',
        "model name\t: AMD Ryzen 9 5950X 16-Core Processor": f"model name\t: {gpu}",
        "0, NVIDIA GeForce RTX 3090, 24576, 23871": f"0, {gpu}, 24576, 23871",
        "Linux 6.5.0-35-generic x86_64": "Linux 6.5.0\u202e\u200b<i>" + "K" * 500 + " x86_64\x07\u2066",
    }
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_a_probe_report_is_stored_printable_and_cut_to_its_fields(db):
    node = NodeFactory(name="tower")
    report = probe.build_report(_hostile_probe_text(), rpc_port=50052)
    # What the parsers do not reach from this recording: the RPC port's holder, a path, a version, a warning.
    report.rpc_port_process = report.llama_version = report.llama_commit = HOSTILE
    report.binaries["llama-server"] = "/opt/" + HOSTILE + "/llama-server"
    report.warnings.append(HOSTILE)
    assert "\u202e" in report.devices[1].description and "\u202e" in report.hostname  # the parsers kept them
    apply_probe_report(node, report)
    node.refresh_from_db()
    assert_clean(node.facts, 1000, where="facts")
    for key, limit in FACT_LIMITS.items():
        assert_clean(node.facts[key], limit, where=key)
    assert node.facts["os_name"].startswith(HTMX.format(tag=""))  # cleaned, not escaped: pages escape
    assert len(node.facts["cpu_model"]) == 200 and node.facts["cpu_model"].endswith(ELLIPSIS)
    devices = {device.name: device for device in node.devices.all()}
    assert set(devices) == {"CPU", "CUDA0"}
    for device in devices.values():
        assert_clean(device.description, 200, where=device.name)
        assert device.description.startswith(HTMX.format(tag=""))


def test_a_nodes_errors_are_stored_printable(db):
    node = NodeFactory(name="flaky")
    record_probe_failure(node, HOSTILE)
    assert_clean(Node.objects.get(pk=node.pk).last_error, 2000, lines=True, where="probe failure")
    node.mark_unreachable("Host said: " + HOSTILE)
    assert_clean(Node.objects.get(pk=node.pk).last_error, 2000, lines=True, where="unreachable")
    node.record_offered_host_key("ssh-ed25519 AAAA", "SHA256:x", changed=True, message=HOSTILE)
    stored = Node.objects.get(pk=node.pk).last_error
    assert_clean(stored, 2000, lines=True, where="host key")
    assert stored.startswith(HTMX.format(tag="")) and "\r" not in stored


def _hostile_gguf(path: Path) -> Path:
    """A small GGUF file whose every string the profile keeps is hostile (the architecture is a key
    prefix too, so the keys carry it)."""
    arch = "lla\u202ema<i hx-post=/users/new/ hx-trigger=load>\x07"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(HOSTILE[:3000])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(1)
    writer.add_context_length(256)
    writer.add_feed_forward_length(16)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.django_db(transaction=True)
def test_a_gguf_files_strings_are_stored_printable_when_registered_or_downloaded(tmp_path, settings):
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path)]
    admin = UserFactory(username="ada", role="admin")
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL)
    path = _hostile_gguf(tmp_path / "hostile.gguf")
    client = Client()
    client.force_login(admin)
    response = client.post(reverse("modelfiles:register"), {"node": desk.pk, "path": str(path)})
    assert response.status_code == 302, response.content.decode()[-3000:]
    model = ModelFile.objects.get()
    # Its name comes from the file's name; general.name stays in the profile, cleaned.
    assert model.name == "hostile"
    assert_clean(model.profile, 1000, where="profile")
    assert model.profile["name"].startswith(HTMX.format(tag="")) and model.profile["name"].endswith(ELLIPSIS)
    assert model.profile["architecture"] == "llama<i hx-post=/users/new/ hx-trigger=load>"
    assert_clean(AuditEvent.objects.get(action="model.register").changes, where="audit")
    # A download registers through the download job's own path.
    job = Job.objects.create(kind="download", node=desk, created_by=admin, state=JobState.RUNNING)
    profile = {**model.profile, "name": HOSTILE, "architecture": HOSTILE, "shards": [HOSTILE]}
    downloaded = _create_model(job, "downloaded", str(tmp_path / "other.gguf"), profile, "")
    downloaded.refresh_from_db()
    assert_clean(downloaded.profile, 1000, where="downloaded profile")


LLAMA_SERVER = """#!/bin/sh
printf 'version: 6800\\342\\200\\256%s\\a\\033[31m (abc1234)\\n' "$(printf 'V%.0s' $(seq 300))"
"""
RPC_SERVER = """#!/bin/sh
printf 'Starting RPC server v7.0.0\\342\\200\\256\\342\\201\\246<i>\\a\\n'
"""


@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_builds_version_and_rpc_banner_are_stored_printable(tmp_path):
    """An existing install on the console's own host whose llama-server and ggml-rpc-server print bidi
    characters, controls and a 300-character version: the build records them cleaned and cut."""
    for name, script in (("llama-server", LLAMA_SERVER), ("ggml-rpc-server", RPC_SERVER)):
        (tmp_path / name).write_text(script)
        (tmp_path / name).chmod(0o755)
    node = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL)
    job = run(
        Job.objects.create(kind="build", node=node, params={"source": "existing", "path": str(tmp_path)})
    )
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job))
    build = Build.objects.get(node=node)
    assert_clean(build.version, 200, where="version")
    assert_clean(build.rpc_protocol, 20, where="protocol")
    assert build.version.startswith("6800VVV") and len(build.version) == 200
    assert build.rpc_protocol == "7.0.0<i>"
    assert_clean(job.result, 500, lines=True, where="result")


def test_deployment_reasons_verification_and_live_status_are_stored_printable(db, tmp_path):
    node = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL)
    model = ModelFile.objects.create(name="m", node=node, profile={"name": HOSTILE})
    assert_clean(ModelFile.objects.get(pk=model.pk).profile, where="profile saved")
    deployment = Deployment.objects.create(name="d", model_file=model, coordinator=node, plan={})
    report = {"devices": {HOSTILE: {"node": HOSTILE}}, "problems": [HOSTILE], "lines": [HOSTILE]}
    deployment.record(
        verification=report, live_status={"processes": [{"error": HOSTILE}], "metrics": {HOSTILE: HOSTILE}}
    )
    deployment.fail("verify", HOSTILE)
    stored = Deployment.objects.get(pk=deployment.pk)
    assert_clean(stored.verification, 1000, lines=True, where="verification")
    assert_clean(stored.live_status, 1000, lines=True, where="live status")
    assert_clean(stored.state_reason, 4000, lines=True, where="reason")
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.RUNNING)
    stored.state = DeploymentState.RUNNING
    assert stored.mark_degraded("llama-server said: " + HOSTILE)
    assert_clean(Deployment.objects.get(pk=deployment.pk).state_reason, 4000, lines=True, where="degraded")
    stored.record(state_reason=HOSTILE)
    assert_clean(Deployment.objects.get(pk=deployment.pk).state_reason, 4000, lines=True, where="recorded")


def test_stale_command_lines_job_results_calibration_and_audit_changes_are_stored_printable(db, monkeypatch):
    node = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL)
    DeviceFactory(node=node, name="CPU")

    async def holders(transport, platform, port):
        return [Holder(pid=4242, name="ggml-rpc-server", cmdline=HOSTILE, kind="rpc-server\u202e")]

    monkeypatch.setattr(monitor, "find_holders", holders)
    assert monitor.scan_stale() == 1
    stale = StaleProcess.objects.get()
    assert_clean(stale.cmdline, 2000, where="cmdline")
    assert_clean(stale.program, 40, where="program")
    assert stale.program == "rpc-server"

    job = Job.objects.create(kind="command", node=node, state=JobState.RUNNING)
    job.finish(JobState.FAILED, result="The node said: " + HOSTILE)
    assert_clean(Job.objects.get(pk=job.pk).result, 500, lines=True, where="result")

    store(node, {"devices": {}, "link": {"rtt_ms": 1.0, "protocol": HOSTILE}, "runs": [HOSTILE]})
    assert_clean(Node.objects.get(pk=node.pk).calibration, 1000, where="calibration")

    event = history.record(None, "deployment.degraded", changes={"reason": HOSTILE, HOSTILE: 1},
                           object_type="deployment", object_repr=HOSTILE)  # fmt: skip
    event.refresh_from_db()
    assert_clean(event.changes, 4000, lines=True, where="audit changes")
    assert_clean(event.object_repr, 200, where="audit object")


def test_the_plain_text_log_download_strips_controls_and_bidi_but_keeps_tabs_and_newlines(db):
    viewer = UserFactory(username="vera", role="viewer")
    node = NodeFactory(name="desk")
    job = Job.objects.create(kind="command", node=node, state=JobState.SUCCEEDED)
    job.append_lines([
        ("out", "name\tsize\u202e\u2066evil\u2069.sh\x07\x9b\u200b"),
        ("err", "two\nlines\x00 \x1b[31mred\x1b[0m\ufeff"),
        ("out", "progress 10%\rprogress 100%"),
    ])  # fmt: skip
    client = Client()
    client.force_login(viewer)
    response = client.get(reverse("jobs:log_download", args=[job.pk]))
    body = b"".join(response.streaming_content).decode()
    assert body == "name\tsizeevil.sh\ntwo\nlines red\nprogress 100%\n"
    html = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert not [c for c in html if _forbidden(c, lines=True)]  # the page's log shows none either


# --- 3. No template marks text safe -------------------------------------------------------------------------

# Where mark_safe may appear: each wraps lines rendered by jobs.broadcast.log_line_html, which escapes.
MARK_SAFE_ALLOWED = {"jobs/templatetags/jobs_tags.py": 2, "jobs/consumers.py": 1, "jobs/views.py": 1}


def test_no_template_marks_text_safe_and_mark_safe_wraps_only_escaped_log_lines():
    root = Path(settings.BASE_DIR)
    unsafe = re.compile(r"\|\s*safe(?:seq)?\b|{%\s*autoescape\s+off")
    found = [f"{p.relative_to(root)}: {m.group(0)}" for p in (root / "templates").rglob("*.html")
             for m in unsafe.finditer(p.read_text())]  # fmt: skip
    assert not found, f"Templates that turn escaping off: {found}"
    calls = {}
    for folder in ("audit", "deployments", "jobs", "nodes", "ramdeck_site"):
        for path in (root / folder).rglob("*.py"):
            count = len(re.findall(r"\bmark_safe\(", path.read_text()))
            if count:
                calls[str(path.relative_to(root))] = count
    assert calls == MARK_SAFE_ALLOWED


def test_djangos_password_help_is_still_a_list_and_a_help_text_from_a_node_is_text(db):
    admin = UserFactory(username="ada", role="admin")
    node = NodeFactory(name="tower")
    Device.objects.create(node=node, name="CUDA0", kind=DeviceKind.CUDA, description=HTMX.format(tag=""),
                          total_bytes=2**34, free_bytes=2**33, bandwidth_gbs=900.0)  # fmt: skip
    client = Client()
    client.force_login(admin)
    create = client.get(reverse("users:create")).content.decode()
    # Built as safe HTML by Django (format_html_join), so it stays a list.
    assert '<div class="help" hx-disable><ul><li>Your password can’t be too similar' in create
    page = client.get(reverse("calibration:figures", args=[node.name])).content.decode()
    assert '<div class="help" hx-disable>&lt;i hx-post=/users/new/ hx-trigger=load&gt;&lt;/i&gt;' in page
    assert "<i hx-post" not in page and "<input name=username" not in page
