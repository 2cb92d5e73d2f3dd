"""The split by hand on the plan page (issue 19): an operator sets blocks (and a mixture of experts' experts)
per device; the form checks them with the planner's memory model, shows the split's predicted speed and
memory beside the planner's and llama.cpp's default, and "Deploy this split" confirms and deploys it through
Confirm's own flow, marked and audited as placed by hand. Bad input is a field error, and nothing is
written."""

from __future__ import annotations

import html
from types import SimpleNamespace

import pytest
from asgiref.sync import async_to_sync
from django.test import Client
from django.urls import reverse

from audit.models import AuditEvent
from builds.models import Build, BuildSource
from deployments.forms import ManualSplitForm
from deployments.models import Deployment, DeploymentState, ResourceClaim
from deployments.steps.llama_server import llama_server_body
from deployments.views.commands import command_lines
from jobs.models import Job
from llamacpp.gguf import profile_path
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import Device, DeviceKind, Node
from planning import manual, planner
from planning.planner import Settings
from remote.base import shell_join
from tests.factories import DeviceFactory
from tests.planning.profiles import make_moe_profile
from tests.planning.test_moe import gpu_desk_and_big_worker

pytestmark = pytest.mark.django_db

MIB = 2**20


def _settings(pool) -> dict:
    """The plan page's settings as its forms post them: both nodes, a context the pool has room for."""
    return {"full": 1, "ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7,
            "nodes": [pool["desk"].pk, pool["pc"].pk]}  # fmt: skip


def _split(pool, layout: str = "desk/CPU,pc/CPU", **counts) -> dict:
    """The split-by-hand form's fields: `counts` as layers_0=2, layers_1=6, ..."""
    return {**_settings(pool), "manual-layout": layout, **{f"manual-{k}": v for k, v in counts.items()}}


def _builds(*nodes, devices=None) -> None:
    for node in nodes:
        Build.objects.create(
            node=node,
            source_kind=BuildSource.EXISTING,
            rpc_protocol="7.0.0",
            rpc_server_path="/opt/llama/ggml-rpc-server",
            llama_server_path="/opt/llama/llama-server",
            devices=devices,
        )


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _nothing_written() -> None:
    assert not Deployment.objects.exists() and not Job.objects.exists() and not ResourceClaim.objects.exists()
    assert not AuditEvent.objects.filter(action__startswith="deployment.").exists()


# ---------------------------------------------------------------------------------------------------------
# The form on the page, for operators


def test_an_operator_gets_the_split_by_hand_starting_from_the_planners_split(model, pool, operator_client):
    page = operator_client.get(reverse("deployments:plan", args=[model.pk]), _settings(pool)).content.decode()
    region = page.split('id="manual-split"')[1].split("</section>")[0]
    plan = planner.plan(model.profile, *_inputs(pool))
    planned = {p["device"] if p["node"] == "desk" else "pc": p["layers"] for p in plan["placements"]}
    assert f'name="manual-layers_0" id="manual-layers_0" min="0" value="{planned["CPU"]}"' in region
    assert f'name="manual-layers_1" id="manual-layers_1" min="0" value="{planned["pc"]}"' in region
    assert 'name="manual-layout" value="desk/CPU,pc/CPU"' in region
    assert 'hx-post="/models/' in region and 'method="post"' in region  # htmx, and a plain POST without JS
    assert 'id="manual-tps">—<' in region  # nothing checked yet
    assert "experts" not in region.split("<table")[1]  # a dense model has no experts to place


def test_a_viewer_sees_the_plan_but_no_split_by_hand_and_may_not_post_one(model, pool, viewer_client):
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), _settings(pool)).content.decode()
    assert 'id="predicted-tps"' in page and 'id="manual-split"' not in page
    response = viewer_client.post(
        reverse("deployments:manual", args=[model.pk]), _split(pool, layers_0=2, layers_1=6)
    )
    assert response.status_code == 403
    response = viewer_client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {**_split(pool, layers_0=2, layers_1=6), "then": "deploy-by-hand"},
    )
    assert response.status_code == 403
    _nothing_written()


def _inputs(pool):
    from nodes.pool import planner_nodes

    return planner_nodes([pool["pc"]], pool["desk"]), Settings(ctx=1024)


def test_a_valid_split_shows_its_speed_and_memory_beside_the_planners_and_the_default(
    model, pool, operator_client
):
    response = operator_client.post(
        reverse("deployments:manual", args=[model.pk]),
        _split(pool, layers_0=3, layers_1=5),
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith(
        '<section class="panel manual-split" id="manual-split"'
    )  # the region only
    nodes, settings = _inputs(pool)
    problem = planner.build_problem(model.profile, nodes, settings)
    devices = manual.manual_devices(problem, [("desk", "CPU"), ("pc", "CPU")])
    split = manual.manual_split(problem, devices, [3, 5])
    expected = planner.plan(model.profile, nodes, settings, split=split)
    ours = planner.plan(model.profile, nodes, settings)
    assert f'id="manual-tps">{expected["predicted_tokens_per_s"]:.1f} tok/s<' in html
    assert f"{ours['predicted_tokens_per_s']:.1f} tok/s" in html  # the planner's, beside it
    _, needs = manual.device_needs(problem, devices, split)
    for need in needs:
        assert need.fits
        cell = html.split(f'data-manual-memory="{need.device.node}/{need.device.device}">')[1].split("</td>")[
            0
        ]
        assert f"{need.used_bytes / MIB:.1f} MiB of {need.capacity_bytes / MIB:.1f} MiB" in cell
    # Checked: the counts ride with Confirm's form, and llama-server's arguments are the split's.
    assert '<input type="hidden" name="manual-layers_0" value="3" form="confirm-form">' in html
    assert "-ngl 6 -ts 6" in html  # pc's 5 blocks and the output layer
    _nothing_written()


def test_without_javascript_the_check_is_a_plain_post_of_the_whole_page(model, pool, operator_client):
    response = operator_client.post(
        reverse("deployments:manual", args=[model.pk]), _split(pool, layers_0=3, layers_1=5)
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert "<html" in page and 'id="manual-tps">' in page and 'id="predicted-tps"' in page
    assert "tok/s" in page.split('id="manual-tps">')[1].split("<")[0]


def test_a_split_posted_with_settings_that_give_no_plan_says_so(model, pool, operator_client):
    data = {**_split(pool, layers_0=3, layers_1=5), "ctx": 2_000_000}
    response = operator_client.post(
        reverse("deployments:manual", args=[model.pk]), data, HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 200
    assert "No split can be checked: the plan's settings do not give a plan" in response.content.decode()
    response = operator_client.post(reverse("deployments:manual", args=[model.pk]), data)
    assert response.status_code == 400 and "Context: Ensure this value" in response.content.decode()
    _nothing_written()


@pytest.mark.parametrize(
    ("counts", "field", "message"),
    [
        ({"layers_0": 0, "layers_1": 9}, "layers_1", "The model has 8 blocks: no device can hold 9."),
        ({"layers_0": 4, "layers_1": 6}, "layers_1", "That makes 10 blocks, 2 more than the model has (8)."),
        ({"layers_0": 1, "layers_1": 5}, None, "2 of the model&#x27;s 8 blocks are on no device yet"),
        ({"layers_0": -1, "layers_1": 9}, "layers_0", "Ensure this value is greater than or equal to 0."),
        ({"layers_0": "two", "layers_1": 6}, "layers_0", "Enter a whole number."),
    ],
)
def test_counts_past_or_short_of_the_models_blocks_are_errors_and_nothing_is_written(
    model, pool, admin_client, counts, field, message
):
    _builds(pool["desk"], pool["pc"])
    response = admin_client.post(reverse("deployments:manual", args=[model.pk]), _split(pool, **counts))
    assert response.status_code == 400
    page = response.content.decode()
    where = page.split(f'id="manual-errors-{field}"' if field else 'id="manual-errors"')[1].split("</ul>")[0]
    assert message in where
    assert 'id="deploy-by-hand"' not in page and "not a valid split" in page
    # Posted to Confirm all the same: refused the same way, nothing confirmed, deployed or audited.
    response = admin_client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {**_split(pool, **counts), "then": "deploy-by-hand", "confirm_token": "bad1"},
    )
    assert response.status_code == 400
    page = response.content.decode()
    assert "Nothing was deployed: the split by hand has errors" in page and message in page
    _nothing_written()


def test_a_device_over_its_memory_is_a_field_error_naming_its_need_and_free_memory(model, pool, admin_client):
    _builds(pool["desk"], pool["pc"])
    response = admin_client.post(
        reverse("deployments:manual", args=[model.pk]), _split(pool, layers_0=0, layers_1=8)
    )
    assert response.status_code == 400
    page = response.content.decode()
    errors = page.split('id="manual-errors-layers_1"')[1].split("</ul>")[0]
    assert "pc / CPU would need " in errors and "but has 14.0 MiB free" in errors
    assert "after the safety margin" in errors
    assert 'class="bad"' in page.split('data-manual-memory="pc/CPU">')[1].split("</td>")[0]
    response = admin_client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {**_split(pool, layers_0=0, layers_1=8), "then": "deploy-by-hand"},
    )
    assert response.status_code == 400 and "pc / CPU would need " in response.content.decode()
    _nothing_written()


def test_a_device_the_build_lacks_is_a_field_error_and_a_split_without_it_deploys(
    model, pool, admin_user, no_enqueue, django_capture_on_commit_callbacks
):
    # pc has a GPU its CPU-only build does not serve.
    DeviceFactory(node=pool["pc"], name="Vulkan0", kind=DeviceKind.VULKAN, total_bytes=64 * MIB,
                  free_bytes=64 * MIB, bandwidth_gbs=200)  # fmt: skip
    _builds(pool["desk"], pool["pc"], devices=[])
    client = _client(admin_user)
    page = client.get(reverse("deployments:plan", args=[model.pk]), _settings(pool)).content.decode()
    layout = page.split('name="manual-layout" value="')[1].split('"')[0]
    names = layout.split(",")
    assert names[0] == "desk/CPU" and set(names) == {"desk/CPU", "pc/CPU", "pc/Vulkan0"}
    gpu, cpu = names.index("pc/Vulkan0"), names.index("pc/CPU")
    on_gpu = {"layers_0": 2, f"layers_{gpu}": 6, f"layers_{cpu}": 0}
    response = client.post(reverse("deployments:manual", args=[model.pk]), _split(pool, layout, **on_gpu))
    assert response.status_code == 400
    errors = response.content.decode().split(f'id="manual-errors-layers_{gpu}"')[1].split("</ul>")[0]
    assert "does not offer Vulkan0" in errors and "Build llama.cpp with the Vulkan backend on pc" in errors
    response = client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {**_split(pool, layout, **on_gpu), "then": "deploy-by-hand"},
    )
    assert response.status_code == 400
    _nothing_written()
    # The same blocks on pc's CPU instead: confirmed and deployed, by hand.
    on_cpu = {"layers_0": 2, f"layers_{gpu}": 0, f"layers_{cpu}": 6}
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("deployments:confirm", args=[model.pk]),
            {**_split(pool, layout, **on_cpu), "then": "deploy-by-hand", "confirm_token": "hand1"},
        )
    assert response.status_code == 302, response.content.decode()[:3000]
    deployment = Deployment.objects.get()
    assert deployment.placed_by_hand and deployment.state == DeploymentState.PREPARING
    assert {p["device"] for p in deployment.plan["placements"] if p["layers"]} == {"CPU"}


# ---------------------------------------------------------------------------------------------------------
# Deploy this split


def test_deploy_this_split_confirms_and_deploys_it_marked_and_audited_as_placed_by_hand(
    model, pool, admin_user, no_enqueue, django_capture_on_commit_callbacks
):
    _builds(pool["desk"], pool["pc"])
    pool["desk"].facts = {"cpu_cores": 4, "cpu_threads_per_core": 1}
    pool["desk"].save(update_fields=["facts"])
    client = _client(admin_user)
    checked = client.post(
        reverse("deployments:manual", args=[model.pk]), _split(pool, layers_0=3, layers_1=5),
        HTTP_HX_REQUEST="true",
    ).content.decode()  # fmt: skip
    assert (
        'id="deploy-by-hand" type="submit" form="confirm-form" name="then" value="deploy-by-hand"' in checked
    )
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("deployments:confirm", args=[model.pk]),
            {**_split(pool, layers_0=3, layers_1=5), "then": "deploy-by-hand", "confirm_token": "hand2",
             "name": "tiny by hand"},
        )  # fmt: skip
    deployment = Deployment.objects.get()
    assert response.status_code == 302 and response["Location"] == reverse(
        "deployments:run", args=[deployment.pk]
    )
    assert deployment.placed_by_hand and deployment.name == "tiny by hand"
    assert deployment.state == DeploymentState.PREPARING and no_enqueue == [("deploy", deployment.pk)]
    plan = deployment.plan
    assert plan["placed_by_hand"] and plan["planner_tokens_per_s"]
    layers = {p["node"]: (p["layers"], p["output_layer"]) for p in plan["placements"]}
    assert layers == {"desk": (3, False), "pc": (5, True)}
    # llama-server's arguments come from the split through the planner's own assembly.
    args = plan["llama_server_args"]
    assert args[args.index("-ngl") + 1] == "6" and args[args.index("-ts") + 1] == "6"
    assert args[args.index("--device") + 1] == "RPC0" and args[args.index("--rpc") + 1] == "10.77.0.2:50052"
    event = AuditEvent.objects.get(action="deployment.confirm_by_hand")
    assert event.object_id == str(deployment.pk) and event.changes["placed_by_hand"] is True
    assert event.changes["split"] == ["desk/CPU: 3 blocks", "pc/CPU: 5 blocks"]
    assert not AuditEvent.objects.filter(action="deployment.confirm").exists()
    detail = client.get(deployment.get_absolute_url()).content.decode()
    assert 'id="placed-by-hand"' in detail and "placed by hand" in detail
    assert "placed by hand" in client.get(reverse("deployments:list")).content.decode()
    # The command-line view is the exact argv the launch runs: environment, --poll 0 and -t included.
    server = detail.split('id="server-command">')[1].split("</pre>")[0]
    assert server.startswith("env GOMP_SPINCOUNT=200 /opt/llama/llama-server -m ")
    assert "-ngl 6 -ts 6" in server and "--poll 0 -t 4 --alias tiny --host 127.0.0.1 --port" in server
    # pc's rpc-server as its step starts it: bound where the deployment's RPC mode says (a tunnel: loopback).
    rpc = detail.split('id="rpc-command-pc">')[1].split("</pre>")[0]
    assert rpc == "env GOMP_SPINCOUNT=200 /opt/llama/ggml-rpc-server -H 127.0.0.1 -p 50052 -d CPU -c"
    audit_page = client.get(reverse("audit")).content.decode()
    assert "confirmed a split placed by hand as" in audit_page


def test_an_operator_is_not_offered_to_deploy_a_split_on_the_consoles_own_host(model, pool, operator_client):
    _builds(pool["desk"], pool["pc"])
    html = operator_client.post(
        reverse("deployments:manual", args=[model.pk]), _split(pool, layers_0=3, layers_1=5),
        HTTP_HX_REQUEST="true",
    ).content.decode()  # fmt: skip
    assert 'id="manual-tps">' in html and 'id="deploy-by-hand"' not in html
    assert "desk is the console&#x27;s own host" in html
    response = operator_client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {**_split(pool, layers_0=3, layers_1=5), "then": "deploy-by-hand"},
    )
    assert response.status_code == 409 and "needs the admin role" in response.content.decode()
    assert not Deployment.objects.exists()


def test_the_plan_pages_command_line_is_the_launchs_with_environment_poll_and_threads(
    model, pool, viewer_client
):
    pool["desk"].facts = {"cpu_cores": 6, "cpu_threads_per_core": 2}
    pool["desk"].save(update_fields=["facts"])
    pool["pc"].facts = {"cpu_cores": 2, "cpu_threads_per_core": 1}
    pool["pc"].save(update_fields=["facts"])
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), _settings(pool)).content.decode()
    server = page.split('id="server-command">')[1].split("</pre>")[0]
    assert server.startswith("env GOMP_SPINCOUNT=200 llama-server -m ")
    assert "--fit off --poll 0 -t 3 --alias tiny --host 127.0.0.1 --port 8080 --api-key-file " in server
    assert server.endswith("--metrics -lv 4")
    rpc = page.split('id="rpc-command-pc">')[1].split("</pre>")[0]
    # Its tensor cache (-c) as the node's limit keeps it (llamacpp/rpc_cache.py).
    assert rpc == "env GOMP_SPINCOUNT=200 ggml-rpc-server -H 10.77.0.2 -p 50052 -d CPU -t 2 -c"


# ---------------------------------------------------------------------------------------------------------
# The form itself, on a mixture of experts (no database: the planner's problem and devices given)


def _moe_form(**counts) -> ManualSplitForm:
    profile = make_moe_profile(n_layer=8, dense_mib=20.0, expert_mib=400.0, output_mib=50.0)
    problem = planner.build_problem(profile, gpu_desk_and_big_worker(), Settings(ctx=512))
    devices = manual.manual_devices(problem)
    layout = ",".join(f"{d.node}/{d.device}" for d in devices)
    data = {"manual-layout": layout, **{f"manual-{k}": v for k, v in counts.items()}}
    return ManualSplitForm(data, problem=problem, devices=devices, prefix="manual")


def test_moe_experts_on_the_big_worker_and_attention_on_the_gpu_is_a_valid_split():
    form = _moe_form(layers_0=0, layers_1=8, layers_2=0, experts_0=0, experts_1=2, experts_2=6)
    assert form.is_valid(), form.errors
    assert form.split.order == [0] and form.split.counts == [8]
    assert sorted(form.split.experts) == [0, 0, 1, 1, 1, 1, 1, 1]
    assert all(need.fits for need in form.needs)


def test_moe_experts_over_a_devices_memory_are_an_error_on_its_experts_field():
    # All experts on the coordinator's CPU, which has 1 GiB: 8 x 400 MiB does not fit.
    form = _moe_form(layers_0=0, layers_1=8, layers_2=0, experts_0=8, experts_1=0, experts_2=0)
    assert not form.is_valid()
    (error,) = form.errors["experts_0"]
    assert error.startswith("desk / CPU would need 3.") and "but has 1.00 GiB free" in error
    assert "layers_0" not in form.errors


def test_moe_experts_that_do_not_add_up_say_how_many_are_left():
    form = _moe_form(layers_0=0, layers_1=8, layers_2=0, experts_0=0, experts_1=2, experts_2=3)
    assert not form.is_valid()
    assert form.non_field_errors() == [
        "3 of the model's 8 blocks with experts are on no device yet: the experts must add up to 8."
    ]


def test_a_form_posted_for_other_devices_is_refused():
    form = _moe_form(layers_0=0, layers_1=8, layers_2=0, experts_0=0, experts_1=8, experts_2=0)
    form.data = {**form.data, "manual-layout": "desk/CPU,big/CPU,desk/CUDA0"}
    assert (
        not form.is_valid() and "The devices changed since the page was shown" in form.non_field_errors()[0]
    )


class _Stop(Exception):
    """Ends the llama-server step once it has started its process (nothing to wait for here)."""


class _Transport:
    shell = "posix"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    async def run(self, argv, timeout=None, check=False):
        if argv[0] == "tail":
            raise _Stop
        return SimpleNamespace(stdout="/home/u\n" if argv[0] == "printenv" else "", lines=[])

    async def write_file(self, path, data, mode=0o600):
        self.files[path] = data


class _Ctx:
    """What the llama-server step uses of a job's context; its start_daemon records the argv."""

    def __init__(self, node, deployment) -> None:
        self.node, self.transport, self.started = node, _Transport(), []
        self.job = SimpleNamespace(params={"deployment": deployment.pk})

    async def start_daemon(self, argv, log_path):
        self.started.append(argv)
        return 4242

    async def log(self, text):
        pass


def test_the_launch_of_a_split_by_hand_runs_what_was_asked_and_what_the_page_shows(
    model, pool, admin_user, no_enqueue, django_capture_on_commit_callbacks
):
    _builds(pool["desk"], pool["pc"])
    pool["desk"].facts = {"cpu_cores": 4, "cpu_threads_per_core": 1}
    pool["desk"].save(update_fields=["facts"])
    client = _client(admin_user)
    with django_capture_on_commit_callbacks(execute=True):
        client.post(
            reverse("deployments:confirm", args=[model.pk]),
            {**_split(pool, layers_0=4, layers_1=4), "then": "deploy-by-hand", "confirm_token": "hand3"},
        )
    deployment = Deployment.objects.get()
    ctx = _Ctx(Node.objects.get(pk=pool["desk"].pk), deployment)
    with pytest.raises(_Stop):
        async_to_sync(llama_server_body)(ctx)
    (argv,) = ctx.started
    # Four blocks on the coordinator's CPU, four and the output layer on pc: -ngl 5, all of it pc's.
    assert argv[:2] == ["env", "GOMP_SPINCOUNT=200"] and argv[2] == "/opt/llama/llama-server"
    assert argv[argv.index("-ngl") + 1] == "5" and argv[argv.index("-ts") + 1] == "5"
    assert argv[argv.index("--device") + 1] == "RPC0" and argv[argv.index("--rpc") + 1] == "10.77.0.2:50052"
    assert argv[argv.index("--poll") + 1] == "0" and argv[argv.index("-t") + 1] == "4"
    detail = client.get(deployment.get_absolute_url()).content.decode()
    shown = html.unescape(detail.split('id="server-command">')[1].split("</pre>")[0])
    assert shown == shell_join(argv)


def test_the_page_shows_the_same_launch_argv_the_step_builds(model, pool):
    """command_lines for a deployment is shell_join of llama_server_launch_argv, the deploy step's own."""
    from llamacpp.args import llama_server_launch_argv

    _builds(pool["desk"])
    plan = planner.plan(model.profile, *_inputs(pool))
    deployment = Deployment.objects.create(
        name="d", model_file=model, coordinator=pool["desk"], plan=plan, port=8099,
        processes={"llama-server@desk": {"role": "llama-server", "key_file": "/home/u/.ramdeck/run/k.key"}},
    )  # fmt: skip
    expected = llama_server_launch_argv(
        "/opt/llama/llama-server", model.path, plan["llama_server_args"], threads=None, alias="tiny",
        host="127.0.0.1", port=8099, key_file="/home/u/.ramdeck/run/k.key",
    )  # fmt: skip
    assert command_lines(model, plan, deployment)["llama_server"] == shell_join(expected)


def test_a_mixture_of_experts_gets_an_experts_field_per_device_and_its_override_rules(
    pool, operator_client, tmp_path
):
    path = write_tiny_llama(tmp_path / "moe.gguf", TinyLlama(n_expert=8, n_expert_used=2))
    model = ModelFile.objects.create(
        name="moe", node=pool["desk"], path=str(path), profile=profile_path(path)
    )
    Device.objects.filter(node__in=[pool["desk"], pool["pc"]]).update(
        total_bytes=256 * MIB, free_bytes=256 * MIB
    )
    page = operator_client.get(reverse("deployments:plan", args=[model.pk]), _settings(pool)).content.decode()
    region = page.split('id="manual-split"')[1].split("</section>")[0]
    assert "Experts of blocks" in region and 'name="manual-experts_1"' in region
    # The blocks on the coordinator, every block's experts on pc: -ot rules put them in its RPC buffer.
    html = operator_client.post(
        reverse("deployments:manual", args=[model.pk]),
        _split(pool, layers_0=8, layers_1=0, experts_0=0, experts_1=8),
        HTTP_HX_REQUEST="true",
    ).content.decode()
    assert 'id="manual-tps">' in html and "tok/s" in html.split('id="manual-tps">')[1].split("</div>")[0]
    command = html.split('id="manual-command">')[1].split("</p>")[0]
    assert (
        "-ot blk\\.(0|1|2|3|4|5|6|7)\\.ffn_(up|down|gate|gate_up)_(ch|)exps=RPC0[10.77.0.2:50052]" in command
    )
    assert "--device RPC0 -ngl 0 -ts 0" in command
