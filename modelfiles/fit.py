"""Whether a model fits the pool, and how fast it would run there: the models list's quick answer."""

from __future__ import annotations

from django.conf import settings

from modelfiles.models import ModelFile
from nodes.models import Node
from nodes.pool import planner_nodes
from planning import planner

POOL_CONTEXTS = (32768, 16384, 8192, 4096, 2048, 1024)
# The plan page's context when the model fits the pool at none of POOL_CONTEXTS (or has no profile).
FALLBACK_CONTEXT = 4096


def trained_context(model: ModelFile) -> int:
    """The context the model was trained for, from its GGUF header; 0 when the file does not say."""
    return int((model.profile or {}).get("context_length") or 0)


def default_coordinator(model: ModelFile, pool: list[Node]) -> Node | None:
    if model.node.may_coordinate and model.node.enabled:
        return model.node
    return next((n for n in pool if n.may_coordinate), None)


def pool_fit(model: ModelFile, pool: list[Node]) -> dict:
    """Whether the model fits the pool, at the longest of a few contexts, and how fast."""
    coordinator = default_coordinator(model, pool)
    if coordinator is None or not model.profile:
        return {"fits": False, "reason": "No node may coordinate." if coordinator is None else "No profile."}
    try:
        nodes = planner_nodes([n for n in pool if n.pk != coordinator.pk], coordinator)
        trained = model.profile.get("context_length") or POOL_CONTEXTS[0]
        for ctx in POOL_CONTEXTS:
            if ctx > trained:
                continue
            cfg = planner.Settings(ctx=ctx, clamp=settings.RAMDECK_UNIFIED_MEMORY_CLAMP)
            fits, tps = planner.quick_fit(model.profile, nodes, cfg)
            if fits:
                return {"fits": True, "ctx": ctx, "tps": tps, "coordinator": coordinator.name}
    except planner.ClusterError as exc:
        return {"fits": False, "reason": str(exc)}
    return {"fits": False, "reason": f"Not even with a context of {POOL_CONTEXTS[-1]}."}


def default_context(model: ModelFile, pool: list[Node], fit: dict | None = None) -> int:
    """The context a plan of this model starts from: the one the models list shows for it (the longest of
    POOL_CONTEXTS that fits, within the trained context), else the fallback, within the trained context."""
    fit = fit if fit is not None else pool_fit(model, pool)
    if fit.get("fits"):
        return int(fit["ctx"])
    trained = trained_context(model)
    return min(FALLBACK_CONTEXT, trained) if trained else FALLBACK_CONTEXT
