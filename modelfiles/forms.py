"""Forms of the model registry: register a file a node already holds, or download one onto a node."""

from __future__ import annotations

import posixpath
import re
from urllib.parse import unquote, urlsplit

from django import forms

from jobs.models import Job
from modelfiles import fetch_policy, local_copy
from modelfiles.models import ModelFile, name_from_path
from nodes.models import Node, Transport
from ramdeck_site.roles import can_administer


def _offer_local_nodes_to_admins_only(form: forms.Form, user) -> None:
    """The console's own host is not offered to others (jobs/models.py refuses them there anyway)."""

    if user is not None and not can_administer(user):
        form.fields["node"].queryset = form.fields["node"].queryset.exclude(transport=Transport.LOCAL)


class ModelRegisterForm(forms.Form):
    name = forms.CharField(
        max_length=200,
        required=False,
        help_text="How the console calls this model; programs ask for it by this name too. Leave it empty "
        "to use the file's name without .gguf.",
    )
    node = forms.ModelChoiceField(
        queryset=Node.objects.filter(enabled=True), help_text="The node that holds it."
    )
    path = forms.CharField(
        max_length=1000, help_text="Path of the GGUF file on that node (the first shard of a split model)."
    )

    def __init__(self, *args, user=None, **kwargs):
        super().__init__(*args, **kwargs)
        _offer_local_nodes_to_admins_only(self, user)

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if name and ModelFile.objects.filter(name=name).exists():
            raise forms.ValidationError("A model with this name is already registered.")
        return name

    def name_from_file(self, profile: dict) -> str:
        """The name to register: the one typed, else the file's name (modelfiles.models.name_from_path). Adds
        a form error (and returns "") when a name taken from the file is already registered. The header's
        general.name is not used: it is often a training run's label ("Smollm2 135M 8k Lc100K Mix1 Ep2")."""
        name = self.cleaned_data["name"]
        if name:
            return name
        name = name_from_path(self.cleaned_data["path"])
        if ModelFile.objects.filter(name=name).exists():
            self.add_error(
                "name", f"The file's name gives {name}, and a model with this name is already registered: "
                "give it another name.",
            )  # fmt: skip
            return ""
        return name

    def clean(self) -> dict:
        data = super().clean()
        if data.get("node") and data.get("path"):
            if not data["path"].startswith("/"):
                self.add_error("path", "Give an absolute path.")
            elif data["node"].is_local and not fetch_policy.under_model_dirs(data["path"]):
                self.add_error(
                    "path",
                    "On the console's own host only files under its model folders can be registered: "
                    f"{fetch_policy.model_dirs_text()}.",
                )
            elif ModelFile.objects.filter(node=data["node"], path=data["path"]).exists():
                self.add_error("path", "This file is already registered on that node.")
        return data


class ModelDownloadForm(forms.Form):
    """A GGUF file from a URL onto a node, as a job (modelfiles/download.py)."""

    url = forms.URLField(
        label="URL", max_length=2000, assume_scheme="https", help_text="http or https; the node downloads it."
    )
    node = forms.ModelChoiceField(queryset=Node.objects.filter(enabled=True), help_text="Where it goes.")
    dest = forms.CharField(
        label="Destination path",
        max_length=1000,
        help_text="Absolute path of the file on that node; ending in / puts the URL's file name there. "
        "On the console's own host: inside its model folder (RAMDECK_MODEL_DIRS).",
    )
    sha256 = forms.CharField(
        label="SHA-256", max_length=64, required=False, help_text="Optional: checked before registering."
    )
    name = forms.CharField(
        max_length=200,
        required=False,
        help_text="How the console (and programs asking for it) call this model; empty: the file's name "
        "without .gguf.",
    )

    def __init__(self, *args, user=None, **kwargs):
        super().__init__(*args, **kwargs)
        _offer_local_nodes_to_admins_only(self, user)

    def clean_url(self) -> str:
        url = self.cleaned_data["url"]
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise forms.ValidationError("Only http and https URLs can be downloaded.")
        if parts.username or parts.password:
            # Job parameters, logs and the audit history are not places for a password.
            raise forms.ValidationError("A URL with a user name or password is not accepted.")
        return url

    def clean_sha256(self) -> str:
        value = self.cleaned_data["sha256"].strip().lower()
        if value and not re.fullmatch(r"[0-9a-f]{64}", value):
            raise forms.ValidationError("A SHA-256 is 64 hexadecimal characters.")
        return value

    def clean(self) -> dict:
        data = super().clean()
        dest, url, node = data.get("dest", "").strip(), data.get("url"), data.get("node")
        if not dest or not url or not node:
            return data
        if not dest.startswith("/"):
            self.add_error("dest", "Give an absolute path.")
            return data
        if dest.endswith("/"):
            dest += posixpath.basename(unquote(urlsplit(url).path))
            if dest.endswith("/"):
                self.add_error("dest", "The URL has no file name; give the whole destination path.")
                return data
        data["dest"] = dest = posixpath.normpath(dest)
        if node.is_local:
            if refusal := fetch_policy.local_dest_refusal(dest):
                self.add_error("dest", refusal)
            if refusal := fetch_policy.literal_refusal(url):
                self.add_error("url", refusal)
        data["name"] = name = data.get("name", "").strip() or name_from_path(dest)
        if ModelFile.objects.filter(name=name).exists():
            self.add_error("name", "A model with this name is already registered.")
        if ModelFile.objects.filter(node=node, path=dest).exists():
            self.add_error("dest", "A model with this path is already registered on that node.")
        elif Job.objects.active().filter(kind="download", node=node, params__dest=dest).exists():
            self.add_error("dest", "A download to this path on that node is already queued or running.")
        return data

    def params(self) -> dict:
        """The job's parameters: the URL shown with its query hidden, the real one encrypted."""
        data = self.cleaned_data
        return {
            **fetch_policy.secret_params(data["url"]),
            "dest": data["dest"],
            "sha256": data["sha256"],
            "name": data["name"],
        }


class RealModelForm(forms.Form):
    """The small real model to try (modelfiles/real_model.py) onto a node, as a job."""

    node = forms.ModelChoiceField(
        queryset=Node.objects.filter(enabled=True),
        help_text="Where it goes: the console fetches it once, then copies or uploads it there.",
    )

    def __init__(self, *args, user=None, **kwargs):
        super().__init__(*args, **kwargs)
        _offer_local_nodes_to_admins_only(self, user)

    def clean_node(self) -> Node:
        node = self.cleaned_data["node"]
        if Job.objects.active().filter(kind="real_model", node=node).exists():
            raise forms.ValidationError(f"The small real model is already on its way to {node.name}.")
        return node


class ModelCopyForm(forms.Form):
    """A model's file copied to another node (a worker) once, so deployments fill that node's RPC cache from
    its own disk (modelfiles/local_copy.py)."""

    model = forms.ModelChoiceField(queryset=ModelFile.objects.select_related("node"))
    node = forms.ModelChoiceField(queryset=Node.objects.filter(enabled=True))
    path = forms.CharField(
        max_length=1000,
        required=False,
        help_text="Where the copy goes on that node (empty: the nodes' model folder, the file's own name; "
        "for a split model, its first shard's, the others beside it). A whole copy already there is "
        "registered without sending anything.",
    )

    def __init__(self, *args, user=None, **kwargs):
        super().__init__(*args, **kwargs)
        _offer_local_nodes_to_admins_only(self, user)

    def clean_path(self) -> str:
        path = self.cleaned_data["path"]
        if not path:
            return ""
        try:
            return local_copy.check_destination(path)
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean(self):
        data = super().clean()
        model, node = data.get("model"), data.get("node")
        if model is None or node is None:
            return data
        if model.node_id == node.pk:
            raise forms.ValidationError(f"{model.name} lives on {node.name} already.")
        if node.platform == "windows":
            raise forms.ValidationError(
                f"{node.name} runs Windows, where copying a model (and filling its RPC cache from the "
                "copy) is not built yet."
            )
        if Job.objects.active().filter(kind=local_copy.KIND, node=node).exists():
            raise forms.ValidationError(f"A model copy to {node.name} is already queued or running.")
        data["path"] = data.get("path") or local_copy.default_destination(model)
        try:
            model.copy_paths(data["path"])  # A split model's shards keep llama.cpp's names.
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data
