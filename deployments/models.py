"""Model files (GGUF) and deployments. Filled in by the planner and deployment work."""

from __future__ import annotations
