"""The measure step's arithmetic: the prediction at the context a measurement filled, how far the measurement
is from it, and what the node showed while it was measured (pure Python, no Django).

A plan prices decode at its full context (every KV cell read by every token: planning/costs.py), which is
what a long conversation reaches, not what a short measurement fills. The plan also carries the prediction
with an empty cache (`predicted_tokens_per_s_empty`) and the cells its context holds (`kv_cells`); the speed
model's time per token is linear in the cells read, so the prediction at n filled cells lies on the line
between the two, in seconds per token. A measurement decodes a fixed length from an empty cache, so the
mean context its tokens read is the prompt and half the decoded tokens.

The node's load while it decoded is read from Linux's /proc (`cpu_use`): the CPU time of the whole machine
and of llama-server over the samples, so what other programs used is what is left; each Linux worker's the
same way, its rpc-server's time as its own (`workers_cpu_use`). A miss then names the
cause it can see: the machine was busy, the prediction was priced at a context the run did not fill, or the
figures the plan rests on (never calibrated, stale, a slower link); only when none shows is it the node the
prediction leaned on most.
"""

from __future__ import annotations

import contextlib
from typing import Any

# A miss beyond this either way is flagged (the deployment page's red badge).
SPEED_ERROR_LIMIT = 0.25
# Other programs using at least this many CPUs' worth of time while llama-server decoded: a busy machine.
BUSY_CPUS = 0.5


def filled_context(prompt_tokens: int, decoded_tokens: int) -> float:
    """The mean number of cells a measurement's tokens read: the prompt, then one more per decoded token."""
    return prompt_tokens + decoded_tokens / 2


def predicted_at(plan: dict[str, Any], filled: float | None) -> tuple[float | None, bool]:
    """(predicted decode tokens/s at `filled` cells of context, whether it is at that context).

    A plan made before the empty-cache prediction was stored gives its full-context figure (and False)."""
    full = plan.get("predicted_tokens_per_s")
    empty = plan.get("predicted_tokens_per_s_empty")
    cells = plan.get("kv_cells")
    if not full:
        return None, False
    if not empty or not cells or filled is None:
        return float(full), False
    share = min(1.0, max(0.0, filled / cells))
    seconds = 1 / empty + (1 / full - 1 / empty) * share
    return 1 / seconds, True


def parse_proc(text: str) -> dict[str, Any]:
    """/proc/loadavg, /proc/stat and /proc/PID/stat, printed one after the other, as numbers:
    {"load1", "total", "busy", "cpus", "own"} (clock ticks; keys missing when their lines are)."""
    out: dict[str, Any] = {"cpus": 0}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "cpu" and len(words) >= 5:
            ticks = [int(w) for w in words[1:9] if w.isdigit()]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            out["total"], out["busy"] = sum(ticks), sum(ticks) - idle
        elif words[0].startswith("cpu") and words[0][3:].isdigit():
            out["cpus"] += 1
        elif ")" in line and "(" in line:
            # PID (comm) state ppid ... utime stime: fields 14 and 15, counted after the comm's ")".
            rest = line.rsplit(")", 1)[1].split()
            if len(rest) >= 13 and rest[11].isdigit() and rest[12].isdigit():
                out["own"] = int(rest[11]) + int(rest[12])
        elif len(words) >= 4 and "/" in words[3]:
            with contextlib.suppress(ValueError):
                out["load1"] = float(words[0])
    return out


def cpu_use(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """What the machine's CPUs did between two `parse_proc` readings: {"cpus", "others_cpus", "own_cpus",
    "load1"}, in CPUs' worth of time (1.0: one CPU busy all along). None when a reading lacks a figure."""
    keys = ("total", "busy", "own")
    if not all(k in before and k in after for k in keys) or not after.get("cpus"):
        return None
    elapsed = after["total"] - before["total"]
    if elapsed <= 0:
        return None
    cpus = after["cpus"]
    own = max(0, after["own"] - before["own"])
    others = max(0, after["busy"] - before["busy"] - own)
    return {
        "cpus": cpus,
        "others_cpus": round(others / elapsed * cpus, 2),
        "own_cpus": round(own / elapsed * cpus, 2),
        "load1": after.get("load1"),
    }


def miss_causes(
    check: dict[str, Any],
    *,
    coordinator: str,
    figures: list[dict[str, str]],
    links: list[dict[str, str]],
) -> list[dict[str, str]]:
    """Why a measurement missed its prediction, likeliest first: [{"node", "kind", "reason"}] with kind
    "load" (the machine was busy while it was measured), "context" (the prediction was priced at a context
    the run did not fill), "calibration" or "link" (the figures the plan rests on: `figures` and `links`,
    already worded). Empty when the measurement is within the limit. `check` is what the measure step
    stored (deployments/steps/checks.py)."""
    error = check.get("error")
    if error is None or abs(error) <= SPEED_ERROR_LIMIT:
        return []
    causes: list[dict[str, str]] = []
    use = check.get("cpu_use") or {}
    if error < 0 and (use.get("others_cpus") or 0) >= BUSY_CPUS:
        load = f", load average {use['load1']:g}" if use.get("load1") is not None else ""
        causes.append(
            {
                "node": coordinator,
                "kind": "load",
                "reason": f"it was busy while it was measured: other programs used {use['others_cpus']:.1f} "
                f"of its {use['cpus']} CPUs{load}; measure again when it is quiet (the figures may be right)",
            }
        )
    for worker, use in sorted((check.get("workers_cpu_use") or {}).items()):
        if error < 0 and (use.get("others_cpus") or 0) >= BUSY_CPUS:
            load = f", load average {use['load1']:g}" if use.get("load1") is not None else ""
            causes.append(
                {
                    "node": worker,
                    "kind": "load",
                    "reason": "it was busy while it was measured: other programs used "
                    f"{use['others_cpus']:.1f} of its {use['cpus']} CPUs{load} beside its rpc-server; "
                    "measure again when it is quiet",
                }
            )
    filled, cells = check.get("filled"), check.get("kv_cells")
    if error > 0 and not check.get("at_filled_context") and filled is not None and cells:
        causes.append(
            {
                "node": coordinator,
                "kind": "context",
                "reason": f"the prediction is priced at the plan's full context ({cells} tokens) and this "
                f"run filled {filled:.0f}: plan again for a prediction at the context used",
            }
        )
    # A link slower than calibrated is named when the figures themselves are measurements.
    if figures:
        causes += [{**row, "kind": "calibration"} for row in figures]
    else:
        causes += [{**row, "kind": "link"} for row in links]
    return causes
