"""Every job kind the apps register names a body and an end hook that exist: a module moved or a function
renamed would otherwise fail only when a job of that kind first runs."""

from __future__ import annotations

import inspect

from django.apps import apps

from jobs import kinds

# Each kind with the app that registers it in its AppConfig.ready().
DEPLOYMENT_KINDS = ("deploy", "heal", "undeploy", "recalibrate", "reap", "rpc_server", "rpc_tunnel",
                    "preflight", "llama_server", "verify", "measure", "stop")  # fmt: skip
EXPECTED = {
    "command": "jobs",
    "probe": "nodes",
    "build": "builds",
    "calibrate": "calibration",
    "download": "modelfiles",
    "real_model": "modelfiles",
    "model_copy": "modelfiles",
    **dict.fromkeys(DEPLOYMENT_KINDS, "deployments"),
}


def test_every_registered_job_kind_resolves_its_body_and_its_end_hook():
    # Registered again as the apps do it: a test module may have put a body of its own in a kind's place.
    for label in sorted(set(EXPECTED.values())):
        apps.get_app_config(label).ready()
    assert set(kinds.names()) >= set(EXPECTED)
    for name, app in EXPECTED.items():
        kind = kinds.get(name)
        assert isinstance(kind.body, str) and kind.body.startswith(f"{app}."), (name, kind.body)
        body = kind.resolve_body()
        assert inspect.iscoroutinefunction(body), f"{name}: {kind.body} is not an async body"
        assert list(inspect.signature(body).parameters) == ["ctx"], f"{name}: {kind.body} takes (ctx)"
        if kind.on_end is not None:
            hook = kinds.import_string(kind.on_end) if isinstance(kind.on_end, str) else kind.on_end
            assert callable(hook), f"{name}: its end hook {kind.on_end} is not callable"
            assert len(inspect.signature(hook).parameters) == 1, f"{name}: {kind.on_end} takes (job)"
