"""`manage.py plan`: plan a GGUF model on a cluster file and print the plan as JSON.

Exit status: 0 the model fits, 3 it does not (the JSON is still printed, with "fits": false), 2 bad input
(a message on stderr naming the problem). Scripts depend on these names and codes.

A Mac is one device, its unified memory: {"name": "MTL0", "kind": "metal", "unified": true, "total_mib": RAM,
"wired_limit_mib": N} (the wired limit only when one is set with sysctl iogpu.wired_limit_mb). As the
coordinator it needs no CPU device: its CPU draws on the same memory, within --clamp of it.
"""

from __future__ import annotations

import json
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from llamacpp import gguf as gguf_profile
from planning import planner

EXIT_FITS = 0
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


class Command(BaseCommand):
    help = "Plan how a GGUF model is split across the devices of a cluster file; print the plan as JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--model", required=True, help="Path of the GGUF file (the first shard if split)."
        )
        parser.add_argument("--cluster", required=True, help="Cluster description (JSON, see issue 4).")
        parser.add_argument("--ctx", type=int, default=4096, help="Context size in tokens (default 4096).")
        parser.add_argument("--parallel", type=int, default=1, help="Parallel slots (default 1).")
        parser.add_argument("--cache-type", choices=sorted(planner.KV_TYPES), default="f16")
        clamp = settings.RAMDECK_UNIFIED_MEMORY_CLAMP
        parser.add_argument(
            "--clamp",
            type=float,
            default=clamp,
            help=f"Share of unified memory to use (default {clamp:g}, from RAMDECK_UNIFIED_MEMORY_CLAMP).",
        )
        parser.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")

    def handle(self, *args, **options) -> None:
        try:
            plan = self._plan(options)
        except (gguf_profile.GGUFError, planner.ClusterError, OSError, json.JSONDecodeError) as exc:
            self.stderr.write(f"plan: {exc}")
            sys.exit(EXIT_BAD_INPUT)
        if options["json"]:
            self.stdout.write(json.dumps(plan))
        else:
            self.stdout.write(json.dumps(plan, indent=2))
        sys.exit(EXIT_FITS if plan["fits"] else EXIT_DOES_NOT_FIT)

    def _plan(self, options: dict) -> dict:
        profile = gguf_profile.profile_path(options["model"])
        try:
            with open(options["cluster"], encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise planner.ClusterError(f"{options['cluster']} is not valid JSON: {exc}") from None
        except OSError as exc:
            raise planner.ClusterError(f"Cannot read the cluster file: {exc}") from None
        nodes = planner.cluster_from_dict(data)
        settings = planner.Settings(
            ctx=options["ctx"],
            parallel=options["parallel"],
            cache_type=options["cache_type"],
            clamp=options["clamp"],
        )
        return planner.plan(profile, nodes, settings)
