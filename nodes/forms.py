"""Forms for nodes and credentials. Secrets are write-only: never rendered back into a page."""

from __future__ import annotations

import re

import asyncssh
from django import forms
from django.conf import settings

from llamacpp.rpc_cache import CacheError, check_folder
from llamacpp.rpc_guard import is_ipv6, parse_ipv4
from nodes.models import Credential, CredentialKind, Node, Transport

# What an edit form shows in a secret field that already has a stored value. Posting it back unchanged
# keeps the stored secret; the real value is never sent to the browser.
SECRET_PLACEHOLDER = "•••••••• (stored; leave as is to keep)"


_LOGIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}")


class NodeForm(forms.ModelForm):
    class Meta:
        model = Node
        fields = [
            "name",
            "address",
            "transport",
            "ssh_port",
            "ssh_user",
            "credential",
            "may_coordinate",
            "rpc_port",
            "rpc_bind_address",
            "rpc_tunnel",
            "authorized_keys_path",
            "rpc_cache_limit_gib",
            "llama_cache_dir",
            "platform_hint",
            "notes",
            "enabled",
        ]
        widgets = {"notes": forms.Textarea(attrs={"rows": 3})}
        labels = {
            "ssh_port": "SSH port",
            "ssh_user": "SSH user",
            "rpc_port": "RPC port",
            "rpc_bind_address": "RPC bind address",
            "rpc_tunnel": "Allow RPC tunnels",
            "authorized_keys_path": "authorized_keys file",
        }
        # One line each in plain words (the fields the model does not already explain); /help/ says more.
        help_texts = {
            "transport": "SSH for another computer; Local for the computer this console runs on.",
            "ssh_port": "The port its SSH server listens on; usually 22.",
            "ssh_user": "The account the console logs in as on that computer.",
            "credential": "The key or password that account logs in with (saved under Credentials).",
            "rpc_port": "The port its ggml-rpc-server listens on when it lends memory to another node.",
            "platform_hint": "Its operating system; Detect asks the computer itself.",
            "llama_cache_dir": "Absolute path given to ggml-rpc-server as LLAMA_CACHE (its entries go in its "
            "rpc folder). Empty: llama.cpp's default, ~/.cache/llama.cpp (~/Library/Caches/llama.cpp on "
            "macOS, %LOCALAPPDATA%\\llama.cpp on Windows).",
            "notes": "Anything worth remembering about this machine; only people see it.",
            "enabled": "Untick to leave this machine out of new plans without deleting it.",
        }

        error_messages = {
            "name": {
                "invalid": "A node name has letters, digits, '-' and '_' only (no spaces), such as old-pc."
            }
        }

    # The console's own host is reached without an address or SSH (the page hides these fields for it).
    LOCAL_ADDRESS = "127.0.0.1"

    rpc_bind_everywhere = forms.BooleanField(
        label="Let ggml-rpc-server listen on every interface",
        required=False,
        help_text="Only with an unspecified bind address (0.0.0.0): anyone on every network this node is on "
        "could then use its unauthenticated RPC server in direct mode. Recorded in the audit history.",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Needed for SSH only (see _clean_ssh): the page hides them for a Local node.
        self.fields["address"].required = False
        self.fields["ssh_port"].required = False
        # Left out of a post (an older page, a script): the node keeps its limit, a new one the default.
        if self.is_bound and "rpc_cache_limit_gib" not in self.data:
            self.data = self.data.copy()
            self.data["rpc_cache_limit_gib"] = self.instance.rpc_cache_limit_gib

    def clean_name(self):
        return self.cleaned_data["name"].strip().lower()

    def clean_ssh_user(self):
        # Only login names: never an option (`-o...`) or shell text wherever the name is used later.
        value = self.cleaned_data["ssh_user"].strip()
        if value and not _LOGIN_NAME.fullmatch(value):
            raise forms.ValidationError(
                "A login name has letters, digits, '.', '_', '-' or '@' only, and does not start with '-'."
            )
        return value

    def clean_address(self):
        return self.cleaned_data["address"].strip()

    def _clean_cache_folder(self, cleaned) -> None:
        """The cache folder in the form of the node's own platform (C:\\x on Windows, /x elsewhere), where
        the probe found it or the operator named it."""
        folder = cleaned.get("llama_cache_dir") or ""
        found = (self.instance.facts or {}).get("platform")
        hint = cleaned.get("platform_hint")
        platform = found if found in ("linux", "macos", "windows") else hint
        if not folder or platform not in ("linux", "macos", "windows"):
            return
        try:
            check_folder(folder, windows=platform == "windows")
        except CacheError as exc:
            self.add_error("llama_cache_dir", str(exc))

    def clean(self):
        cleaned = self._clean_ssh(super().clean())
        self._clean_cache_folder(cleaned)
        value = (cleaned.get("rpc_bind_address") or "").strip()
        if not value:
            return cleaned
        if is_ipv6(value):
            self.add_error(
                "rpc_bind_address",
                f"{value} is an IPv6 address; ggml-rpc-server listens on IPv4 only. Give an IPv4 address.",
            )
            return cleaned
        address = parse_ipv4(value)
        # ggml-rpc-server has no authentication: `0`, `00`, `0x0` mean every interface too (inet_aton).
        if address is not None and address.is_unspecified and not cleaned.get("rpc_bind_everywhere"):
            self.add_error(
                "rpc_bind_address",
                f"{value} means every interface ({address}): it exposes the unauthenticated RPC server "
                "on every network; give the node's LAN address, or tick the box below to allow it.",
            )
            return cleaned
        if address is not None:
            cleaned["rpc_bind_address"] = str(address)  # the normalised form rpc-server will bind
        return cleaned

    def _clean_ssh(self, cleaned):
        if cleaned.get("transport") == Transport.LOCAL:
            if not cleaned.get("address") and "address" not in self.errors:
                cleaned["address"] = self.LOCAL_ADDRESS
            if cleaned.get("ssh_port") is None and "ssh_port" not in self.errors:
                cleaned["ssh_port"] = 22
        if cleaned.get("transport") == Transport.SSH:
            if not cleaned.get("address") and "address" not in self.errors:
                self.add_error("address", "An SSH node needs its address (a host name or an IP address).")
            if cleaned.get("ssh_port") is None and "ssh_port" not in self.errors:
                self.add_error(
                    "ssh_port", "An SSH node needs the port its SSH server listens on (usually 22)."
                )
            if not cleaned.get("ssh_user"):
                self.add_error("ssh_user", "An SSH node needs the user to log in as.")
            if not cleaned.get("credential"):
                self.add_error("credential", "An SSH node needs a credential (a private key or a password).")
        self._refuse_the_same_machine_twice(cleaned)
        return cleaned

    def _refuse_the_same_machine_twice(self, cleaned: dict) -> None:
        """One machine as two nodes would count its memory twice in every plan."""
        others = Node.objects.exclude(pk=self.instance.pk)
        if cleaned.get("transport") == Transport.LOCAL:
            local = others.filter(transport=Transport.LOCAL).first()
            if local is not None:
                self.add_error("transport", same_machine_message(local))
        elif cleaned.get("address") and cleaned.get("ssh_port"):
            twin = others.filter(
                transport=Transport.SSH, address__iexact=cleaned["address"], ssh_port=cleaned["ssh_port"]
            ).first()
            if twin is not None:
                self.add_error(
                    "address",
                    f"Node {twin.name} already reaches {twin.address} on SSH port {twin.ssh_port}: the same "
                    "machine twice would count its memory twice. Edit that node instead.",
                )


def same_machine_message(local: Node) -> str:
    return (
        f"This console's own host is already node {local.name}: the same machine twice would count its "
        "memory twice. Edit that node instead."
    )


def generate_key_pair(comment: str) -> tuple[str, str, str]:
    """A new ed25519 key pair: (private key in OpenSSH format, public key line, SHA-256 fingerprint)."""
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    return (
        key.export_private_key("openssh").decode(),
        key.export_public_key("openssh").decode().strip(),
        key.get_fingerprint("sha256"),
    )


class CredentialForm(forms.ModelForm):
    """Create or edit a credential. The secret can be pasted or uploaded (private keys), or the console
    generates a new ed25519 key pair and shows its public half to put on the nodes."""

    generate = forms.BooleanField(
        label="Generate a new key pair for me (ed25519)",
        required=False,
        help_text="The console keeps the private key (encrypted) and shows you the public key, with the "
        "line to run on each node. Leave the secret empty.",
    )

    secret = forms.CharField(
        label="Secret",
        required=False,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 6, "autocomplete": "off", "spellcheck": "false"}),
        help_text="A private key in OpenSSH or PEM format, or the password.",
    )
    key_file = forms.FileField(label="…or upload the key file", required=False)
    passphrase = forms.CharField(
        label="Key passphrase",
        required=False,
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}),
        help_text="Only for a private key that is protected by a passphrase.",
    )

    class Meta:
        model = Credential
        fields = ["name", "kind"]

    # The generate box comes right after the kind: a person deciding how to get a key sees it first.
    field_order = ["name", "kind", "generate", "secret", "key_file", "passphrase"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.has_stored_secret = bool(self.instance.pk and self.instance.secret_encrypted)
        self.secret_was_cleared = False
        if self.has_stored_secret:
            self.fields["secret"].initial = SECRET_PLACEHOLDER
            self.fields["secret"].help_text += " The stored value is kept unless you replace it."

    def full_clean(self):
        super().full_clean()
        if self.is_bound and self._errors:
            # A form with errors re-renders; a secret that was typed or pasted must not travel back to the
            # browser inside it. The person pastes it again (the message above the form says so).
            self.data = self.data.copy()
            self.data["secret"] = SECRET_PLACEHOLDER if self.has_stored_secret else ""
            self.data.pop("passphrase", None)
            self.secret_was_cleared = True

    def clean_key_file(self):
        upload = self.cleaned_data.get("key_file")
        if upload and upload.size > settings.RAMDECK_MAX_UPLOAD_BYTES:
            raise forms.ValidationError(
                f"The file is {upload.size:,} bytes; a key file is at most "
                f"{settings.RAMDECK_MAX_UPLOAD_BYTES:,} bytes."
            )
        return upload

    def clean(self):
        cleaned = super().clean()
        secret = cleaned.get("secret") or ""
        upload = cleaned.get("key_file")
        if cleaned.get("generate"):
            return self._clean_generated(cleaned, secret, upload)
        if upload:
            try:
                secret = upload.read().decode("utf-8")
            except UnicodeDecodeError:
                self.add_error("key_file", "The file is not a text key file (it is not valid UTF-8).")
                return cleaned
        keep_stored = self.has_stored_secret and secret in ("", SECRET_PLACEHOLDER)
        if keep_stored:
            cleaned["new_secret"] = None
            return cleaned
        if secret in ("", SECRET_PLACEHOLDER):
            self.add_error("secret", "Enter the password or paste the private key (or upload it).")
            return cleaned
        if len(secret.encode()) > settings.RAMDECK_MAX_UPLOAD_BYTES:
            self.add_error("secret", "That is too long to be a key or a password.")
            return cleaned
        passphrase = cleaned.get("passphrase") or ""
        if cleaned.get("kind") == CredentialKind.PRIVATE_KEY:
            cleaned["fingerprint"] = self._check_private_key(secret, passphrase)
        else:
            cleaned["fingerprint"] = ""
            passphrase = ""
        cleaned["new_secret"] = secret
        cleaned["new_passphrase"] = passphrase
        return cleaned

    def _clean_generated(self, cleaned: dict, secret: str, upload) -> dict:
        if cleaned.get("kind") != CredentialKind.PRIVATE_KEY:
            self.add_error("generate", "Only a private-key credential can have a generated key pair.")
            return cleaned
        if upload or secret not in ("", SECRET_PLACEHOLDER):
            self.add_error(
                "generate", "Either paste or upload a key, or let the console generate one: not both."
            )
            return cleaned
        comment = f"ramdeck:{cleaned.get('name') or 'key'}"
        cleaned["new_secret"], cleaned["public_key"], cleaned["fingerprint"] = generate_key_pair(comment)
        cleaned["new_passphrase"] = ""
        return cleaned

    def _check_private_key(self, secret: str, passphrase: str) -> str:
        try:
            key = asyncssh.import_private_key(secret.strip() + "\n", passphrase or None)
        except asyncssh.KeyEncryptionError:
            self.add_error("passphrase", "The passphrase does not open this key.")
            return ""
        except (asyncssh.KeyImportError, ValueError) as exc:
            if "passphrase" in str(exc).lower():
                self.add_error("passphrase", "This key is protected by a passphrase; enter it below.")
            else:
                self.add_error(
                    "secret", "This is not a private key that can be read (OpenSSH, PEM or PKCS#8)."
                )
            return ""
        self.cleaned_data["public_key"] = key.export_public_key("openssh").decode().strip()
        return key.get_fingerprint("sha256")

    def save(self, commit: bool = True) -> Credential:
        credential = super().save(commit=False)
        new_secret = self.cleaned_data.get("new_secret")
        if new_secret is not None:
            credential.set_secret(new_secret, self.cleaned_data.get("new_passphrase", ""))
            credential.public_fingerprint = self.cleaned_data.get("fingerprint", "")
            credential.public_key = self.cleaned_data.get("public_key", "")
        if commit:
            credential.save()
        return credential


class NodeFilterForm(forms.Form):
    q = forms.CharField(label="Search", required=False)
    transport = forms.ChoiceField(choices=[("", "Any transport"), *Transport.choices], required=False)
    status = forms.ChoiceField(
        choices=[
            ("", "Any status"),
            ("enabled", "Enabled"),
            ("disabled", "Disabled"),
            ("reachable", "Reachable"),
            ("unreachable", "Unreachable"),
        ],
        required=False,
    )
