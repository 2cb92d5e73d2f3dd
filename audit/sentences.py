"""Audit entries as sentences a person reads: "alice changed node this-box: name from — to this-box".

Pure functions of an entry's fields (no queries): `sentence(event)` for the whole line, `what(event)` and
`details(event)` for its two halves. Values are written as words, never as Python reprs (None, lists,
bytes, dicts). An action this module has no phrase for still reads as words ("deployment rpc exposed").
"""

from __future__ import annotations

import re
from typing import Any

# "{actor} <phrase> {object}" for each known action. "{object}" is the object's type and name.
PHRASES = {
    "login": "logged in",
    "logout": "logged out",
    "user.password_change": "changed their password",
    "user.create": "added user {name}",
    "user.update": "changed user {name}",
    "user.unlock": "unlocked user {name} after failed logins",
    "node.create": "added {object}",
    "node.update": "changed {object}",
    "node.delete": "deleted {object}",
    "node.probe": "started a hardware probe of {object}",
    "node.calibrate": "started a calibration of {object}",
    "node.calibrate_all": "started calibrating every node",
    "node.host_key.approve": "approved the SSH host key of {object}",
    "credential.create": "added {object}",
    "credential.update": "changed {object}",
    "credential.delete": "deleted {object}",
    "device.bandwidth_override": "set the bandwidth figure of {object}",
    "job.create": "started {object}",
    "job.cancel": "cancelled {object}",
    "build.requested": "asked for a llama.cpp build on {object}",
    "model.register": "registered {object}",
    "model.download": "started a model download ({object})",
    "model.copy": "started copying {object} to another node",
    "model.copy.registered": "registered a copy of {object} on another node",
    "process.reap_requested": "asked to end a stale process on {object}",
    "process.reaped": "ended stale processes on {object}",
    "deployment.confirm": "confirmed the plan of {object}",
    "deployment.confirm_by_hand": "confirmed a split placed by hand as {object}",
    "deployment.deploy": "deployed {object}",
    "deployment.stop": "stopped {object}",
    "deployment.recalibrate": "stopped {object} to calibrate a node and start it again",
    "deployment.redeploy": "redeployed {object}",
    "deployment.delete": "deleted {object}",
    "deployment.delete_refused": "was refused deleting {object}",
    "deployment.refused": "was refused deploying {object}",
    "deployment.failed": "marked {object} failed",
    "deployment.recovered": "saw {object} recover",
    "deployment.running": "saw {object} running",
    "deployment.stopped": "ended every process of {object}",
    "deployment.degraded": "saw {object} stop working",
    "deployment.heal_started": "started an attempt to heal {object}",
    "deployment.healed": "healed {object}",
    "node.offline": "lost contact with {object}",
    "node.online": "reached {object} again",
    "deployment.heal_failed": "could not heal {object}",
    "deployment.stop_failed": "could not stop {object}",
    "deployment.self_heal": "switched self-healing of {object}",
    "deployment.api_key_viewed": "viewed the API key of {object}",
    "deployment.rpc_exposed": "let the RPC servers of {object} listen on every interface",
}
EMPTY = "—"
_BYTES_REPR = re.compile(r"^b(['\"])(.*)\1$", re.S)


# The console's own parts, which act without a person (deployments/monitor.py, lifecycle/healing.py, …).
SYSTEM_ACTORS = {
    "": "the console",
    "console": "the console",
    "monitor": "the console's monitor",
    "self-heal": "the console's self-healing",
    "probe": "the console's probe",
    "retention": "the console's clean-up",
}


def actor_of(event) -> str:
    name = event.actor_name or ""
    if getattr(event, "actor_id", None) is None and name in SYSTEM_ACTORS:
        return SYSTEM_ACTORS[name]
    return name or "the console"


# Model names (Django's lower-cased class names) as people say them.
OBJECT_TYPES = {"modelfile": "model", "staleprocess": "stale process"}


def object_of(event) -> str:
    kind = OBJECT_TYPES.get(event.object_type or "", (event.object_type or "").replace("_", " "))
    name = event.object_repr or ""
    return f"{kind} {name}".strip() or "something"


def what(event) -> str:
    """The sentence without its details: "alice added node this-box"."""
    action = event.action or ""
    if action == "login.failed":
        changes = event.changes or {}
        text = f"a login as {value_text(event.object_repr or changes.get('username'))} failed"
        if unrecorded := changes.get("not_recorded_before"):
            # ramdeck_site/login_audit.py leaves some out when they come fast; this entry counts them.
            text += f" (after {value_text(unrecorded)} more with unknown usernames, not recorded one by one)"
        return text
    if action == "permission_denied":
        changes = event.changes or {}
        path = changes.get("path") or "a page"
        needed = changes.get("needed")
        return f"{actor_of(event)} was refused {path}" + (f" (it needs the {needed} role)" if needed else "")
    phrase = PHRASES.get(action)
    if phrase is None:
        words = action.replace(".", " ").replace("_", " ")
        return f"{actor_of(event)}: {words}" + (f" ({object_of(event)})" if event.object_repr else "")
    text = phrase.format(object=object_of(event), name=event.object_repr or "")
    return f"{actor_of(event)} {text}"


def details(event) -> str:
    """The changes as words: "name from — to this-box; may coordinate: yes"."""
    if event.action in ("permission_denied", "login.failed"):
        return ""
    parts = []
    # In key order: PostgreSQL's jsonb keeps keys by length, SQLite as written; the sentence is the same.
    for key, value in sorted((event.changes or {}).items()):
        label = str(key).replace("_", " ")
        if isinstance(value, list | tuple) and len(value) == 2 and _is_change(key):
            parts.append(f"{label} from {value_text(value[0])} to {value_text(value[1])}")
        else:
            parts.append(f"{label}: {value_text(value)}")
    return "; ".join(parts)


def sentence(event) -> str:
    more = details(event)
    return f"{what(event)}: {more}" if more else what(event)


def _is_change(key: str) -> bool:
    """[old, new] pairs come from form changes; a few keys hold real two-item lists (e.g. "nodes")."""
    return key not in ("nodes", "argv", "ports", "shard_paths", "flags")


def value_text(value: Any) -> str:
    """A stored value as words: None → —, True → yes, lists joined, dicts as "key value" pairs."""
    if value is None or value == "":
        return EMPTY
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, list | tuple):
        return ", ".join(value_text(item) for item in value) if value else EMPTY
    if isinstance(value, dict):
        return ", ".join(f"{str(k).replace('_', ' ')} {value_text(v)}" for k, v in value.items()) or EMPTY
    text = str(value)
    match = _BYTES_REPR.match(text)
    return match.group(2) if match else text
