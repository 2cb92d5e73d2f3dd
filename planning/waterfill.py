"""The clamped waterfill search: the split with the least predicted time per token that fits.

llama.cpp keeps the first blocks on the coordinator's CPU and gives the rest to the listed devices as
contiguous slices, the output layer with the last one. For each choice of last device, the other devices are
put in a canonical order (nodes by their fastest device, devices by bandwidth) and a dynamic programme over
"blocks placed so far" picks the exact block count of every device (0 = leave it out) minimising predicted
time under the memory limits (planning/costs.py). When all blocks have the same size (as in real
models, up to quantisation mixes), device order only matters through which device is last, so the result is
optimal over every order and split; tests/planning/test_planner.py proves it against exhaustive search. The
same holds for a coordinator whose CPU and unified GPU (a Mac) share one pool (`_canonical_groups`,
`_pool_gpu_last`).
"""

from __future__ import annotations

import math

import numpy as np

from planning.costs import PIPELINE_COPIES, Problem, Split

# ---------------------------------------------------------------------------------------------------------
# The search


def _canonical_groups(problem: Problem) -> list[list[int]]:
    """Slot indices grouped by node: nodes by their fastest device, devices by bandwidth (then by name).

    A coordinator's unified GPU, which shares one pool with the CPU, comes first in a group of its own:
    unless it holds the output layer its slice then starts where the CPU's ends, so the search knows the
    CPU's bytes when it sizes that slice (local devices need not be next to each other; remote ones do,
    for their node's round trips).
    """
    by_node: dict[str, list[int]] = {}
    for i, s in enumerate(problem.slots):
        if i != problem.pool_slot:
            by_node.setdefault(s.node.name, []).append(i)
    groups = [
        sorted(idx, key=lambda i: (-problem.slots[i].bandwidth, problem.slots[i].device.name))
        for idx in by_node.values()
    ]
    groups.sort(key=lambda g: (-problem.slots[g[0]].bandwidth, problem.slots[g[0]].node.name))
    return ([[problem.pool_slot]] if problem.pool_slot is not None else []) + groups


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
        # What a token reads of blocks j..k-1 (less than they hold for a mixture of experts).
        self.read_span = problem.read_prefix[None, :] - problem.read_prefix[:, None]
        self.upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # k > j
        self.diag = np.eye(n + 1, dtype=bool)
        self.out_bytes = float(problem.profile["output_bytes"])
        self._cache: dict[tuple, np.ndarray] = {}

    def used(self, i: int, last: bool, copies: int) -> np.ndarray:
        """Bytes slot i holds with blocks j..k-1 (and the output layer when last), by (j, k)."""
        s = self.p.slots[i]
        role = "out" if last else "mid"
        fixed = np.full((self.n + 1, 1), s.compute_for(role, copies) + (self.out_bytes if last else 0.0))
        # Row 0: its blocks start at block 0, which takes a little more compute buffer (`first_block_bytes`).
        fixed[0] = s.compute_for(role, copies, first=True) + (self.out_bytes if last else 0.0)
        if last:
            # Rows j >= n - 1: the output device holds at most the last block (smaller compute buffer).
            fixed[self.n - 1] = s.compute_for("tail", copies, first=self.n == 1) + self.out_bytes
            fixed[self.n] = s.compute_for("logits", copies) + self.out_bytes
        return self.span + fixed

    def matrix(self, i: int, last: bool, copies: int, cpu_bytes: float | None = None) -> np.ndarray:
        """Cost of giving blocks j..k-1 to slot i (inf where it does not fit or is not a use).

        For the unified GPU that shares the coordinator's pool, the CPU's bytes count too: `cpu_bytes` when
        the caller knows them, else those of a CPU holding blocks 0..j-1 (the slice follows the CPU's).
        """
        key = (i, last, copies, cpu_bytes)
        if key not in self._cache:
            s = self.p.slots[i]
            used = self.used(i, last, copies)
            ok = (used <= s.capacity) & (self.upper | (self.diag if last else False))
            if i == self.p.pool_slot:
                cpu = self.cpu_used(copies)[:, None] if cpu_bytes is None else cpu_bytes
                ok &= cpu + used <= self.p.pool_capacity
            cost = (self.read_span + (self.out_bytes if last else 0.0)) / s.bandwidth
            self._cache[key] = np.where(ok, cost, INF)
        return self._cache[key]

    def cpu_used(self, copies: int) -> np.ndarray:
        """Bytes on the coordinator's CPU with blocks 0..j-1 and not the output layer, by j."""
        c = self.p.cpu
        used = self.p.kv_prefix + self.p.cpu_weights + c.compute_for("mid", copies)
        # With no block of its own the CPU's compute buffer is much smaller.
        used[0] = self.p.cpu_weights[0] + c.compute_for("idle", copies)
        return used

    def cpu_costs(self, copies: int, output: bool) -> np.ndarray:
        c = self.p.cpu
        if output:
            used = self.p.kv_prefix + self.p.cpu_weights_out + c.compute_for("out", copies)
        else:
            used = self.cpu_used(copies)
        read = self.p.read_prefix + (self.out_bytes if output else 0.0)
        return np.where(used <= c.capacity, read / c.bandwidth, INF)

    def run(
        self,
        order: list[list[int]],
        start: np.ndarray,
        copies: int,
        record: bool,
        *,
        has_last: bool = True,
        pool_cpu_bytes: float | None = None,
    ):
        """Returns final cost array and, when recording, the choices for backtracking.

        The last slot of `order` holds the output layer unless `has_last` is false (a shared prefix).
        Without recording, `start` may carry leading dimensions (a batch of start vectors).
        `pool_cpu_bytes`: the CPU's bytes when the pool's GPU does not follow the CPU (see `matrix`).
        """
        f = start
        trace: list[tuple] = []
        cols = np.arange(self.n + 1)
        last_slot = order[-1][-1] if has_last and order else -1

        def best(step: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            """The cheapest way into every column, and when recording which row it came from."""
            if not record:
                return step.min(-2), None
            rows = step.argmin(0)
            return step[rows, cols], rows

        for group in order:
            # A remote node with one device is a local device plus its overhead: no second state needed.
            remote = self.p.slots[group[0]].remote and len(group) > 1
            if remote:
                a, b = f, np.full_like(f, INF)
            for i in group:
                is_last = i == last_slot
                m = self.matrix(i, is_last, copies, pool_cpu_bytes if i == self.p.pool_slot else None)
                if remote:
                    va, ja = best(a[..., :, None] + self.p.slots[i].overhead_s + m)
                    vb, jb = best(b[..., :, None] + m)
                    keep_b = np.full_like(b, INF) if is_last else b
                    # 0: skip this slot, 1: first use of the node, 2: more
                    choice = np.stack([keep_b, va, vb])
                    if record:
                        pick = choice.argmin(0)
                        nb = choice[pick, cols]
                        trace.append(("r", i, pick, ja, jb))
                    else:
                        nb = choice.min(0)
                    na = np.full_like(a, INF) if is_last else a
                    a, b = na, nb
                else:
                    slot = self.p.slots[i]
                    cost = slot.time_with_overhead(m) if slot.remote else m
                    v, j = best(f[..., :, None] + cost)
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
    # (cost, order, start, copies, the CPU's bytes for the pool's GPU when it does not follow the CPU)
    best_run: tuple[float, list[list[int]], np.ndarray, int, float | None] | None = None
    start = s.cpu_costs(1, output=False)
    # Mode 1: some blocks stay on the CPU (no pipeline parallelism): CPU count >= 1.
    start1 = start.copy()
    start1[0] = INF
    # Mode 2: nothing on the CPU and a single device (no pipeline parallelism).
    start2 = np.full(n + 1, INF)
    start2[0] = start[0]
    # Mode 3: nothing on the CPU, pipeline parallelism on (four compute copies; on CPU workers, input copies).
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
            if slot.compute_for("logits", 1) + s.out_bytes > slot.capacity:
                continue  # it cannot hold the output layer at all
            order = _order_for_last(groups, last)
            rest = order[k:]  # after the shared prefix groups[:k]
            runs = [
                (prefixes[0][k], 1, rest, order, start1),
                (start2, 1, [[last]], [[last]], start2),
                (prefixes[1][k], PIPELINE_COPIES, rest, order, start3),
            ]
            for st_k, copies, tail_order, full_order, st in runs:
                pool_cpu = None
                if last == problem.pool_slot and len(full_order) > 1:
                    cost, st, pool_cpu = _pool_gpu_last(s, full_order, st, copies)
                else:
                    cost = float(s.run(tail_order, st_k, copies, record=False)[0][n])
                if cost < INF and (best_run is None or cost < best_run[0] * (1 - 1e-12)):
                    # A mode-3 optimum on a single device is never strictly better than mode 2 on it.
                    best_run = (cost, full_order, st, copies, pool_cpu)
    if best_run is not None:
        cost, ord_, st, copies, pool_cpu = best_run
        _, trace = s.run(ord_, st, copies, record=True, pool_cpu_bytes=pool_cpu)
        consider(cost, Split(*s.backtrack(trace, n)))
    if best is None:
        return None, INF
    # The coordinator's fixed cost per pass is the same for every split: added once, after the search.
    return best[1], best[0] + problem.fixed_s


def _pool_gpu_last(
    s: _Search, order: list[list[int]], start: np.ndarray, copies: int
) -> tuple[float, np.ndarray, float]:
    """(least cost, the start for recording it, the CPU's bytes) with the pool's GPU last in `order`.

    That GPU shares its pool with the CPU, whose bytes depend on its block count j, and the devices between
    them hide j from a search over blocks placed so far: every j is searched as a start of its own (a batch),
    unless the pool holds the CPU's and the GPU's bytes together whatever j is (the usual case).
    """
    n, p = s.n, s.p
    gpu = p.slots[p.pool_slot]
    # The GPU holds blocks a..n-1 and the output layer, for every a.
    used = s.used(p.pool_slot, True, copies)[:, n]
    cpu = s.cpu_used(copies)
    fits = used <= gpu.capacity
    # CPU block counts that leave the pool room for at least the output layer on the GPU.
    start = np.where(cpu + used[n] <= p.pool_capacity, start, INF)
    rows = np.flatnonzero(start < INF)
    if rows.size == 0 or not fits.any():
        return INF, start, 0.0
    # At worst the GPU starts where the CPU stops (it holds more the earlier it starts).
    first = int(np.argmax(fits))
    if (cpu[rows] + used[np.maximum(rows, first)]).max() <= p.pool_capacity:
        return float(s.run(order, start, copies, record=False, pool_cpu_bytes=0.0)[0][n]), start, 0.0
    batch = np.full((rows.size, n + 1), INF)
    batch[np.arange(rows.size), rows] = start[rows]
    f, _ = s.run(order[:-1], batch, copies, record=False, has_last=False)
    cost = (s.read_span[:, n] + s.out_bytes) / gpu.bandwidth
    ok = fits & (cpu[rows][:, None] + used <= p.pool_capacity)
    totals = np.where(ok, f + cost, INF).min(1)
    b = int(totals.argmin())
    j = int(rows[b])
    return float(totals[b]), np.where(np.arange(n + 1) == j, start, INF), float(cpu[j])
