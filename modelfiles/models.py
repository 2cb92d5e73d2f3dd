"""GGUF model files: where a model lives on which node, its size and checksum, and the planner's
memory profile read from its header."""

from __future__ import annotations

import posixpath
import re

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from jobs.models import refuse_local_node
from llamacpp import gguf as gguf_profile
from remote.text import printable, printable_json

# The shard suffix of a split model's files: `Model-00001-of-00003.gguf`.
_SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


def name_from_path(path: str) -> str:
    """The name a model gets when nobody typed one: its file's name without `.gguf` and without a split
    model's shard suffix, so `SmolLM2-135M-Instruct.Q4_1.gguf` is `SmolLM2-135M-Instruct.Q4_1`. The name is
    also the model's API id (llama-server's `--alias`), and the file name is what people chose and
    recognise, unlike the header's `general.name`, which is often the training run's label."""
    base = posixpath.basename(path.rstrip("/"))
    stem = base[: -len(".gguf")] if base.lower().endswith(".gguf") else base
    stem = _SHARD_SUFFIX.sub("", stem)
    return " ".join(printable(stem or base, 200).split())


class ModelFile(models.Model):
    """A GGUF model on a node. `profile` is the parsed memory profile (llamacpp/gguf.py)."""

    name = models.CharField(max_length=200, unique=True)
    node = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="model_files")
    path = models.CharField(max_length=1000, help_text="Path of the (first) GGUF file on the node.")
    shard_paths = models.JSONField(default=list, blank=True, help_text="Every shard, first included.")
    size_bytes = models.BigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True)
    # A split model's shards each have their own SHA-256 (`sha256` is the first one's, the file at `path`):
    # computed on the model's node once, when a copy needs them, in `shard_paths`' order.
    shard_sha256 = models.JSONField(default=list, blank=True, editable=False)
    profile = models.JSONField(default=dict)
    # The FNV-1a hash (ggml-rpc-server's cache file name) and SHA-256 of each tensor above the RPC cache's
    # threshold, computed once by the console (llamacpp/tensor_cache.py): what fills a worker's cache from
    # its own copy, and how a cache's files are matched to the models they hold.
    tensor_hashes = models.JSONField(default=dict, blank=True, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["node", "path"], name="unique_model_path_per_node")]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("modelfiles:detail", args=[self.pk])

    @property
    def is_split(self) -> bool:
        """Whether the model is split into several files (shards): `path` is the first one."""
        return len(self.shard_paths or [self.path]) > 1

    @property
    def files(self) -> list[str]:
        """Every file of the model in order: a split model's shards (the first is `path`), else `path`."""
        return list(self.shard_paths) if self.is_split else [self.path]

    def copy_paths(self, first: str) -> list[str]:
        """Where each of the model's files lies in a copy whose first file is at `first`: a split model's
        other shards beside it under llama.cpp's shard names (`NAME-0000k-of-0000N.gguf`), which is how
        llama-server finds them from the first. Raises ValueError when `first` is not named as the first of
        that many."""
        if not self.is_split:
            return [first]
        count = len(self.shard_paths)
        try:
            return gguf_profile.shard_paths(first, count)
        except gguf_profile.MissingShard:
            raise ValueError(
                f"{self.name} is split into {count} files: the destination must name its first shard, "
                f"NAME-00001-of-{count:05d}.gguf, so that llama.cpp finds the others beside it."
            ) from None

    def save(self, *args, **kwargs):
        if self._state.adding and self.created_by_id:
            # A model on the console's own host (registered by path or downloaded) needs an admin.
            refuse_local_node(self.created_by, self.node, "Models")
        # Whoever made the file wrote its header's strings (general.name, the architecture, ...): printable
        # text only, however the model was registered.
        self.profile = printable_json(self.profile or {})
        super().save(*args, **kwargs)


class ModelCopy(models.Model):
    """A copy of a model's file on another node (a worker): copied there by the console, or found there
    whole. Its size and SHA-256 were checked on that node against the model's (for a split model: `path` is
    the first shard's copy, the others lie beside it under llama.cpp's shard names, each checked against its
    own SHA-256; `size_bytes` is the whole model's, `sha256` the first shard's); a deployment that places
    blocks on the node fills its RPC tensor cache from this copy before its rpc-server starts
    (deployments/steps/local_copy.py), so the weights need not cross the network."""

    model = models.ForeignKey(ModelFile, on_delete=models.CASCADE, related_name="copies")
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="model_copies")
    path = models.CharField(max_length=1000)
    size_bytes = models.BigIntegerField(default=0)
    sha256 = models.CharField(max_length=64)
    verified_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["model__name", "node__name"]
        constraints = [models.UniqueConstraint(fields=["model", "node"], name="one_copy_per_model_and_node")]

    def __str__(self) -> str:
        return f"{self.model} on {self.node}: {self.path}"
