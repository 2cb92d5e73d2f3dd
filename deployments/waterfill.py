"""The clamped waterfill search: the split with the least predicted time per token that fits.

llama.cpp keeps the first blocks on the coordinator's CPU and gives the rest to the listed devices as
contiguous slices, the output layer with the last one. For each choice of last device, the other devices are
put in a canonical order (nodes by their fastest device, devices by bandwidth) and a dynamic programme over
"blocks placed so far" picks the exact block count of every device (0 = leave it out) minimising predicted
time under the memory limits (deployments/memory_model.py). When all blocks have the same size (as in real
models, up to quantisation mixes), device order only matters through which device is last, so the result is
optimal over every order and split; tests/test_planner.py proves it against exhaustive search.
"""

from __future__ import annotations

import math

import numpy as np

from .memory_model import PIPELINE_COPIES, Problem, Split

# ---------------------------------------------------------------------------------------------------------
# The search


def _canonical_groups(problem: Problem) -> list[list[int]]:
    """Slot indices grouped by node: nodes by their fastest device, devices by bandwidth (then by name)."""
    by_node: dict[str, list[int]] = {}
    for i, s in enumerate(problem.slots):
        by_node.setdefault(s.node.name, []).append(i)
    groups = [
        sorted(idx, key=lambda i: (-problem.slots[i].bandwidth, problem.slots[i].device.name))
        for idx in by_node.values()
    ]
    groups.sort(key=lambda g: (-problem.slots[g[0]].bandwidth, problem.slots[g[0]].node.name))
    return groups


def _order_for_last(groups: list[list[int]], last: int) -> list[list[int]]:
    out = [g for g in groups if last not in g]
    home = [i for i in next(g for g in groups if last in g) if i != last] + [last]
    return out + [home]


INF = math.inf


class _Search:
    """Dynamic programme over 'blocks placed so far' for a fixed device order (see module docstring)."""

    def __init__(self, problem: Problem):
        self.p = problem
        n = len(problem.block_bytes)
        self.n = n
        pre = problem.prefix
        span = pre[None, :] - pre[:, None]  # span[j, k] = bytes of blocks j..k-1
        self.span = span
        self.upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # k > j
        self.diag = np.eye(n + 1, dtype=bool)
        self.out_bytes = float(problem.profile["output_bytes"])
        self._cache: dict[tuple[int, bool, int], np.ndarray] = {}

    def matrix(self, i: int, last: bool, copies: int) -> np.ndarray:
        """Cost of giving blocks j..k-1 to slot i (inf where it does not fit or is not a use)."""
        key = (i, last, copies)
        if key not in self._cache:
            s = self.p.slots[i]
            fixed = s.compute_for("out" if last else "mid", copies) + (self.out_bytes if last else 0.0)
            if last:
                # Rows j >= n - 1: the output device holds at most the last block (smaller compute buffer).
                fixed = np.full((self.n + 1, 1), fixed)
                fixed[self.n - 1 :] = s.compute_for("tail", copies) + self.out_bytes
            ok = (self.span + fixed <= s.capacity) & (self.upper | (self.diag if last else False))
            cost = (self.span + (self.out_bytes if last else 0.0)) / s.bandwidth
            self._cache[key] = np.where(ok, cost, INF)
        return self._cache[key]

    def cpu_costs(self, copies: int, output: bool) -> np.ndarray:
        c = self.p.cpu
        fixed = (
            self.p.cpu_base
            + c.compute_for("out" if output else "mid", copies)
            + (self.out_bytes if output else 0)
        )
        pre = self.p.prefix
        if not output:
            # With no block of its own the CPU's compute buffer is much smaller.
            fixed = np.full(len(pre), float(fixed))
            fixed[0] = self.p.cpu_base + c.compute_for("idle", copies)
        ok = pre + fixed <= c.capacity
        return np.where(ok, (pre + (self.out_bytes if output else 0.0)) / c.bandwidth, INF)

    def run(
        self, order: list[list[int]], start: np.ndarray, copies: int, record: bool, *, has_last: bool = True
    ):
        """Returns final cost array and, when recording, the choices for backtracking.

        The last slot of `order` holds the output layer unless `has_last` is false (a shared prefix).
        """
        f = start
        trace: list[tuple] = []
        cols = np.arange(self.n + 1)
        last_slot = order[-1][-1] if has_last and order else -1
        for group in order:
            # A remote node with one device is a local device plus its overhead: no second state needed.
            remote = self.p.slots[group[0]].remote and len(group) > 1
            if remote:
                a, b = f, np.full_like(f, INF)
            for i in group:
                is_last = i == last_slot
                m = self.matrix(i, is_last, copies)
                if remote:
                    ovh = self.p.slots[i].overhead_s
                    from_a = a[:, None] + ovh + m
                    from_b = b[:, None] + m
                    if record:
                        ja, jb = from_a.argmin(0), from_b.argmin(0)
                        va, vb = from_a[ja, cols], from_b[jb, cols]
                    else:
                        va, vb = from_a.min(0), from_b.min(0)
                    keep_b = np.full_like(b, INF) if is_last else b
                    choice = np.stack(
                        [keep_b, va, vb]
                    )  # 0: skip this slot, 1: first use of the node, 2: more
                    pick = choice.argmin(0)
                    nb = choice[pick, cols]
                    na = np.full_like(a, INF) if is_last else a
                    if record:
                        trace.append(("r", i, pick, ja, jb))
                    a, b = na, nb
                else:
                    step = f[:, None] + (m + self.p.slots[i].overhead_s if self.p.slots[i].remote else m)
                    if record:
                        j = step.argmin(0)
                        v = step[j, cols]
                    else:
                        v = step.min(0)
                    if is_last:
                        pick = np.ones(self.n + 1, dtype=int)
                        nf = v
                    else:
                        better = v < f
                        pick = better.astype(int)
                        nf = np.where(better, v, f)
                    if record:
                        trace.append(("l", i, pick, j))
                    f = nf
            if remote:
                use_b = b < a
                if record:
                    trace.append(("merge", use_b))
                f = np.where(use_b, b, a)
        return f, trace

    def backtrack(self, trace, n: int) -> tuple[int, list[int], list[int]]:
        k = n
        state = None  # for remote groups: "a" or "b"
        order: list[int] = []
        counts: list[int] = []
        for entry in reversed(trace):
            if entry[0] == "merge":
                state = "b" if entry[1][k] else "a"
            elif entry[0] == "l":
                _, i, pick, j = entry
                if pick[k] == 1:
                    order.append(i)
                    counts.append(int(k - j[k]))
                    k = int(j[k])
            else:
                _, i, pick, ja, jb = entry
                if state == "a":
                    continue
                p = pick[k]
                if p == 0:
                    continue
                j = int(ja[k] if p == 1 else jb[k])
                order.append(i)
                counts.append(k - j)
                k = j
                state = "a" if p == 1 else "b"
        order.reverse()
        counts.reverse()
        return k, order, counts


def search(problem: Problem) -> tuple[Split | None, float]:
    """The best split under the model, or (None, inf) when nothing fits."""
    s = _Search(problem)
    n = s.n
    best: tuple[float, Split] | None = None

    def consider(cost: float, split: Split) -> None:
        nonlocal best
        if cost < INF and (best is None or cost < best[0] * (1 - 1e-12)):
            best = (cost, split)

    # Everything on the coordinator's CPU.
    everything = s.cpu_costs(1, output=True)
    consider(float(everything[n]), Split(n, [], []))
    groups = _canonical_groups(problem)
    best_run: tuple[float, list[list[int]], np.ndarray, int] | None = None
    start = s.cpu_costs(1, output=False)
    # Mode 1: some blocks stay on the CPU (no pipeline parallelism): CPU count >= 1.
    start1 = start.copy()
    start1[0] = INF
    # Mode 2: nothing on the CPU and a single device (no pipeline parallelism).
    start2 = np.full(n + 1, INF)
    start2[0] = start[0]
    # Mode 3: nothing on the CPU, pipeline parallelism on (x4 compute everywhere).
    start3 = np.full(n + 1, INF)
    start3[0] = s.cpu_costs(PIPELINE_COPIES, output=False)[0] + problem.pipeline_s
    modes = ((start1, 1), (start3, PIPELINE_COPIES))
    # The order for a last device in group k starts with groups 1..k-1 in canonical order: share that prefix.
    prefixes = []
    for st, copies in modes:
        states = [st]
        for group in groups[:-1]:
            states.append(s.run([group], states[-1], copies, record=False, has_last=False)[0])
        prefixes.append(states)
    for k, group in enumerate(groups):
        for last in group:
            slot = problem.slots[last]
            if slot.compute_for("tail", 1) + s.out_bytes > slot.capacity:
                continue  # it cannot hold the output layer at all
            order = _order_for_last(groups, last)
            rest = order[k:]  # after the shared prefix groups[:k]
            runs = [
                (prefixes[0][k], 1, rest, order, start1),
                (start2, 1, [[last]], [[last]], start2),
                (prefixes[1][k], PIPELINE_COPIES, rest, order, start3),
            ]
            for st_k, copies, tail_order, full_order, st in runs:
                f, _ = s.run(tail_order, st_k, copies, record=False)
                if f[n] < INF and (best_run is None or f[n] < best_run[0] * (1 - 1e-12)):
                    # A mode-3 optimum on a single device is never strictly better than mode 2 on it.
                    best_run = (float(f[n]), full_order, st, copies)
    if best_run is not None:
        cost, ord_, st, copies = best_run
        _, trace = s.run(ord_, st, copies, record=True)
        consider(cost, Split(*s.backtrack(trace, n)))
    if best is None:
        return None, INF
    # The coordinator's fixed cost per pass is the same for every split: added once, after the search.
    return best[1], best[0] + problem.fixed_s
