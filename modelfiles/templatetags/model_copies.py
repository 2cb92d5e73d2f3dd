"""The node page's view of the models a node holds beyond those registered on it: the models whose tensors its
RPC cache holds (matched by the cache files' names, the FNV-1a hashes recorded on each model), its copies of
models, and the models an operator may copy to it, with what a copy costs against streaming."""

from __future__ import annotations

from django import template

from llamacpp import tensor_cache
from modelfiles import local_copy
from modelfiles.models import ModelCopy, ModelFile

register = template.Library()


@register.simple_tag
def cache_models(node) -> list[dict]:
    """The models with a tensor in the node's RPC cache as last read: tensors held, of all, bytes."""
    names = (node.rpc_cache_state or {}).get("names")
    if not names:
        return []
    rows = []
    for model in ModelFile.objects.exclude(tensor_hashes={}):
        held, total, size = tensor_cache.held(model.tensor_hashes, names)
        if held:
            rows.append({"model": model, "held": held, "total": total, "bytes": size})
    return rows


@register.simple_tag
def copies_on(node) -> list[ModelCopy]:
    return list(ModelCopy.objects.filter(node=node).select_related("model"))


@register.simple_tag
def copy_offers(node) -> list[dict]:
    """The models on other nodes, with what streaming costs this node per cold start against one copy of the
    whole model (every shard of a split one)."""
    if node.platform == "windows":
        return []
    models = ModelFile.objects.exclude(node=node).exclude(copies__node=node)
    offers = (
        local_copy.offer(m, node) for m in models.select_related("node").prefetch_related("deployments")
    )
    return [o for o in offers if o is not None]
