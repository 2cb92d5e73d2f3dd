"""Where a mixture of experts' routed experts go: the search over splits that place them apart.

A block of a mixture of experts is a small dense part (attention, router, shared experts, norms, its KV
cache) that every token reads, and its routed experts, large in memory, of which a token reads
expert_used_count / expert_count. llama.cpp places the dense parts as it places dense blocks (contiguous
slices, `-ts`), and moves tensors elsewhere with `--override-tensor` (`-ot`): so a block's experts may sit on
another device than the rest of the block, such as a big-RAM node's memory while the attention runs on a
fast GPU. Any override turns llama.cpp's pipeline parallelism off, so every split searched here runs with
one copy of the compute graph (planning/costs.py `pipeline_parallel`).

The search is a dynamic programme like planning/waterfill.py's, over two counts: the dense blocks placed so
far (a prefix of the model) and the blocks whose experts are placed so far. Every device, in the canonical
order, takes a slice of the dense blocks and holds the experts of some number of blocks: its own first,
then other devices' (`assign_split`). With blocks of the same size, which blocks' experts a device holds does
not change the cost, only how many, and whether they are its own (a block whose experts are elsewhere pays
the RPC cost of the remote devices on its way, `costs.excursion_s`): a device that holds fewer experts
than it has blocks sends the others away and takes none in, which no optimum does better than. The order
of the devices matters through which one is last and, when the coordinator's CPU holds no block, which one
takes block 0 (its compute buffer is larger: `costs.first_block_bytes`): the search tries each device first,
the others in canonical order after it. So the result is optimal over every placement of blocks and
experts; tests/planning/test_moe.py proves it against exhaustive search. Blocks of different sizes are
planned with the largest experts' bytes for memory, so the plan always fits, and priced by `evaluate`.

A coordinator whose CPU shares one memory with its GPU (a Mac) keeps each block's experts with the block.
"""

from __future__ import annotations

import numpy as np

from planning.costs import EXPERTS_ON_CPU, Problem, Split, evaluate, excursion_s
from planning.waterfill import INF, _canonical_groups, _order_for_last


def places_experts(problem: Problem) -> bool:
    """Whether the search of experts apart applies: a mixture of experts, no unified pool."""
    return problem.pool_slot is None and any(problem.expert_bytes)


class _Tables:
    """The costs of one device's share, by (first block j, end block k, experts held h)."""

    def __init__(self, problem: Problem):
        self.p = problem
        n = self.n = len(problem.block_bytes)
        moe = np.array([1 if e else 0 for e in problem.expert_bytes])
        self.nm = int(moe.sum())
        experts = [e for e in problem.expert_bytes if e]
        self.unit_mem = float(max(experts))
        self.unit_read = float(sum(r for r in problem.expert_read if r)) / len(experts)
        xmem = np.concatenate([[0.0], np.cumsum(np.array(problem.expert_bytes, dtype=np.float64))])
        xread = np.concatenate([[0.0], np.cumsum(np.array(problem.expert_read, dtype=np.float64))])
        mcount = np.concatenate([[0], np.cumsum(moe)])

        def span(prefix):
            return prefix[None, :] - prefix[:, None]

        # By (j, k): the dense part of blocks j..k-1 in memory (with KV) and as read, and how many of them
        # have experts. Only k >= j is used.
        self.dense_mem = span(problem.prefix) - span(xmem)
        # The coordinator's CPU holding blocks 0..j-1, by j: the file range llama.cpp maps for them (with and
        # without the output layer, `costs.cpu_weight_tables`) and their KV, less their experts.
        self.cpu_dense = {
            output: np.asarray(table, dtype=np.float64) + problem.kv_prefix - xmem
            for output, table in ((False, problem.cpu_weights), (True, problem.cpu_weights_out))
        }
        self.dense_read = span(problem.read_prefix) - span(xread)
        self.own = span(mcount)
        self.h = np.arange(self.nm + 1, dtype=np.float64)
        self.out_bytes = float(problem.profile["output_bytes"])
        jj, kk = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        self.upper = kk > jj
        self.diag = kk == jj
        self.valid = kk >= jj
        self._cache: dict[tuple, np.ndarray] = {}

    def device(self, i: int, last: bool, first_use: bool) -> np.ndarray:
        key = ("device", i, last, first_use)
        if key not in self._cache:
            self._cache[key] = self._device(i, last, first_use)
        return self._cache[key]

    def host(self, i: int) -> np.ndarray:
        key = ("host", i)
        if key not in self._cache:
            self._cache[key] = self._host(i)
        return self._cache[key]

    def excursions(self, slot, own: np.ndarray) -> np.ndarray:
        """By (j, k, h): what the blocks sent away or taken in pay (`costs.excursion_s`)."""
        cost = excursion_s(slot)
        return cost * np.abs(own[:, :, None] - self.h[None, None, :])

    def _device(self, i: int, last: bool, first_use: bool) -> np.ndarray:
        """Slot i holding blocks j..k-1 (at least one unless `last`; the output layer when `last`) and the
        experts of h blocks; `first_use`: it is the first of its node's devices in the chain."""
        s = self.p.slots[i]
        h = self.h[None, None, :]
        own = self.own[:, :, None]
        more = h > own  # it holds other blocks' experts too
        jj = np.arange(self.n + 1)[:, None, None]
        kk = np.arange(self.n + 1)[None, :, None]
        first = (jj == 0) & (kk > jj)  # its blocks start at block 0 (`costs.evaluate`'s `first`)

        def buffer(role: str) -> np.ndarray:
            return np.where(first, s.compute_for(role, 1, first=True), s.compute_for(role, 1))

        if last:
            # `costs._role`: the output layer alone, or with only the last block; no other block's experts.
            logits = (kk == jj) & ~more
            tail = (kk - jj == 1) & (kk == self.n) & ~more
            compute = np.where(
                logits, s.compute_for("logits", 1), np.where(tail, buffer("tail"), buffer("out"))
            )
        else:
            compute = buffer("mid")
        fixed = self.out_bytes if last else 0.0
        # It keeps its own blocks' experts first (`_assign`): some of them elsewhere while it holds some.
        apart = np.where((h > 0) & (h < own), s.apart_extra, 0)
        used = self.dense_mem[:, :, None] + h * self.unit_mem + compute + apart + fixed
        work = (self.dense_read[:, :, None] + h * self.unit_read + fixed) / s.bandwidth
        time = s.time_with_overhead(work) if s.remote and first_use else s.quota_time(work)
        cost = time + self.excursions(s, self.own)
        shape = (self.upper | self.diag) if last else self.upper
        ok = (used <= s.capacity) & shape[:, :, None]
        return np.where(ok, cost, INF)

    def _host(self, i: int) -> np.ndarray:
        """Slot i holding no block, only the experts of h blocks, by h (0 costs nothing: it is left out)."""
        s = self.p.slots[i]
        used = self.h * self.unit_mem + s.compute_for("mid", 1)
        cost = s.quota_time(self.h * self.unit_read / s.bandwidth) + excursion_s(s) * self.h
        cost = np.where(used <= s.capacity, cost, INF)
        cost[0] = 0.0
        return cost

    def cpu(self, output: bool) -> np.ndarray:
        """The coordinator's CPU holding blocks 0..j-1 (all of them and the output layer when `output`) and
        the experts of h blocks, by (j, h)."""
        c = self.p.cpu
        h = self.h[None, :]
        own = self.own[0][:, None]
        more = h > own
        holds_blocks = np.arange(self.n + 1)[:, None] > 0
        if output:
            compute = np.where(holds_blocks, c.compute_for("out", 1, first=True), c.compute_for("out", 1))
        else:
            idle = ~holds_blocks & ~more
            mid = np.where(holds_blocks, c.compute_for("mid", 1, first=True), c.compute_for("mid", 1))
            compute = np.where(idle, c.compute_for("idle", 1), mid)
        fixed = self.out_bytes if output else 0.0
        used = self.cpu_dense[output][:, None] + h * self.unit_mem + compute
        work = (self.dense_read[0][:, None] + h * self.unit_read + fixed) / c.bandwidth
        cost = np.where(used <= c.capacity, c.quota_time(work), INF)
        if output:
            cost[: self.n] = INF
        return cost


def _conv(f: np.ndarray, t: np.ndarray) -> np.ndarray:
    """new[k, m] = min over j, h of f[j, m - h] + t[j, k, h]."""
    n1, m1 = f.shape
    new = np.full((t.shape[1], m1), INF)
    finite = np.isfinite(t)
    # Only the rows that can be left and the columns that can be reached (most are out of memory).
    rows = np.flatnonzero(np.isfinite(f).any(1) & finite.any((1, 2)))
    if rows.size == 0:
        return new
    cols = np.flatnonzero(finite[rows].any((0, 2)))
    hs = np.flatnonzero(finite[rows][:, cols].any((0, 1)))
    if cols.size == 0:
        return new
    fr = f[rows]
    tr = t[np.ix_(rows, cols)]
    for h in hs[hs < m1]:
        cand = (fr[:, None, : m1 - h] + tr[:, :, h][:, :, None]).min(0)
        new[cols, h:] = np.minimum(new[cols, h:], cand)
    return new


def _host_conv(f: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """new[k, m] = min over h of f[k, m - h] + cost[h]."""
    m1 = f.shape[1]
    new = np.full_like(f, INF)
    for h in range(m1):
        if cost[h] < INF:
            new[:, h:] = np.minimum(new[:, h:], f[:, : m1 - h] + cost[h])
    return new


class _Run:
    """One order of devices, its tables kept for backtracking."""

    def __init__(self, tables: _Tables):
        self.t = tables
        self.steps: list[tuple] = []

    def run(
        self, order: list[list[int]], start: np.ndarray, last_slot: int | None, paid: str | None = None
    ) -> np.ndarray:
        """The costs by (blocks placed, experts placed) after `order`; `paid`: the node whose overhead a
        device earlier in the chain already paid (the runs with a chosen first device)."""
        t = self.t
        f = start
        for group in order:
            remote = t.p.slots[group[0]].remote and len(group) > 1
            node_paid = t.p.slots[group[0]].node.name == paid
            if remote:
                a, b = (np.full_like(f, INF), f) if node_paid else (f, np.full_like(f, INF))
                for i in group:
                    last = i == last_slot
                    first = t.device(i, last, True)
                    more = t.device(i, last, False)
                    host = t.host(i)
                    options_b = [("dev", a, first, "a"), ("dev", b, more, "b")]
                    if not last:
                        options_b.append(("host", b, host, "b"))
                    nb = self._best(options_b)
                    na = np.full_like(a, INF) if last else self._best([("host", a, host, "a")])
                    self.steps.append(("ab", i, a, b, first, more, host, last))
                    a, b = na, nb
                self.steps.append(("merge", a, b))
                f = np.minimum(a, b)
            else:
                for i in group:
                    last = i == last_slot
                    dev = t.device(i, last, not node_paid)
                    options = [("dev", f, dev, None)]
                    if not last:
                        options.append(("host", f, t.host(i), None))
                    self.steps.append(("one", i, f, dev, None if last else t.host(i), last))
                    f = self._best(options)
        return f

    @staticmethod
    def _best(options) -> np.ndarray:
        out = None
        for kind, f, table, _ in options:
            v = _conv(f, table) if kind == "dev" else _host_conv(f, table)
            out = v if out is None else np.minimum(out, v)
        return out

    def backtrack(self, k: int, m: int) -> tuple[int, int, list[tuple[int, int, int]]]:
        """From the final state (k, m): the CPU's (blocks, experts) and each used slot's
        (slot, blocks, experts), in order."""
        picks: list[tuple[int, int, int]] = []
        state = None
        for step in reversed(self.steps):
            if step[0] == "merge":
                _, a, b = step
                state = "b" if b[k, m] < a[k, m] else "a"
                continue
            if step[0] == "one":
                _, i, f, dev, host, _last = step
                candidates = [("dev", f, dev)] + ([("host", f, host)] if host is not None else [])
            else:
                _, i, a, b, first, more, host, last = step
                if state == "a":
                    candidates = [("host", a, host)]
                else:
                    candidates = [("dev", a, first, "a"), ("dev", b, more, "b")]
                    if not last:
                        candidates.append(("host", b, host, "b"))
            k, m, used, state = self._choose(candidates, k, m, state)
            if used is not None:
                picks.append((i, *used))
        picks.reverse()
        return k, m, picks

    def _choose(self, candidates, k: int, m: int, state):
        best = (INF, None)
        for cand in candidates:
            kind, f, table = cand[0], cand[1], cand[2]
            new_state = cand[3] if len(cand) > 3 else state
            if kind == "host":
                for h in range(m + 1):
                    v = f[k, m - h] + table[h]
                    if v < best[0]:
                        best = (v, (k, m - h, (0, h) if h else None, new_state))
            else:
                for h in range(min(table.shape[2], m + 1)):
                    col = f[:, m - h] + table[:, k, h]
                    j = int(col.argmin())
                    if col[j] < best[0]:
                        best = (col[j], (j, m - h, (k - j, h), new_state))
        return best[1]


def assign_split(
    problem: Problem, cpu: tuple[int, int], picks: list[tuple[int, int, int]], last: int | None
) -> Split:
    """The split for the counts the search chose: each device keeps the experts of its last blocks, and the
    blocks it sends away go, in block order, to the devices that take some in."""
    n = len(problem.block_bytes)
    moe = [bool(e) for e in problem.expert_bytes]
    order, counts = [], []
    shares = [(EXPERTS_ON_CPU, 0, cpu[0], cpu[1])]
    start = cpu[0]
    hosts = []
    for i, blocks, held in picks:
        if blocks or i == last:
            order.append(i)
            counts.append(blocks)
            shares.append((i, start, blocks, held))
            start += blocks
        else:
            hosts.append((i, start, 0, held))
    shares += sorted(hosts)
    experts = [0] * n
    away: list[int] = []
    wants: list[tuple[int, int]] = []
    for key, first, blocks, held in shares:
        own = [b for b in range(first, first + blocks) if moe[b]]
        keep = min(len(own), held)
        for b in range(first, first + blocks):
            experts[b] = key
        away += own[: len(own) - keep]
        if held > keep:
            wants.append((key, held - keep))
    away.sort()
    for key, count in wants:
        for b in away[:count]:
            experts[b] = key
        away = away[count:]
    return Split(cpu[0], order, counts, experts)


def search_experts(problem: Problem) -> tuple[Split | None, float]:
    """The best split with experts placed by `-ot` rules, or (None, inf) when nothing fits."""
    t = _Tables(problem)
    n, nm = t.n, t.nm
    best: tuple[float, Split] | None = None

    def consider(run: _Run, f: np.ndarray, last: int | None) -> None:
        nonlocal best
        if not f[n, nm] < INF:
            return
        k, m, picks = run.backtrack(n, nm)
        split = assign_split(problem, (k, m), picks, last)
        ev = evaluate(problem, split)
        if ev.fits and (best is None or ev.seconds_per_token < best[0] * (1 - 1e-12)):
            best = (ev.seconds_per_token, split)

    groups = _canonical_groups(problem)
    # Everything on the coordinator's CPU, experts anywhere.
    everything = t.cpu(output=True)
    start = np.full((n + 1, nm + 1), INF)
    start[n] = everything[n]
    run = _Run(t)
    consider(run, run.run(groups, start, None), None)
    start = t.cpu(output=False)
    # The order for a last device in group k starts with groups 0..k-1 in canonical order: share that prefix.
    prefix = _Run(t)
    states = [(start, [])]
    for group in groups[:-1]:
        f = prefix.run([group], states[-1][0], None)
        states.append((f, list(prefix.steps)))
    lasts = [
        last
        for group in groups
        for last in group
        if problem.slots[last].compute_for("logits", 1) + t.out_bytes <= problem.slots[last].capacity
    ]
    for k, group in enumerate(groups):
        for last in group:
            if last not in lasts:
                continue
            run = _Run(t)
            f, run.steps = states[k][0], list(states[k][1])
            rest = _order_for_last(groups, last)[k:]
            consider(run, run.run(rest, f, last), last)
    # No block on the coordinator's CPU: the device that takes block 0 holds more compute buffer
    # (`costs.first_block_bytes`), so the order matters through which device is first too.
    no_cpu_block = np.full_like(start, INF)
    no_cpu_block[0] = start[0]
    for first in range(len(problem.slots)):
        slot = problem.slots[first]
        paid = slot.node.name if slot.remote else None
        others = [[i for i in g if i != first] for g in groups]
        others = [g for g in others if g]
        for last in lasts:
            if last == first:
                continue  # alone, or after others that took no block: the canonical runs cover it
            run = _Run(t)
            f = run.run([[first]], no_cpu_block, None)
            f[0] = INF  # it takes block 0 (at least one block), so its node's overhead is paid
            consider(run, run.run(_order_for_last(others, last), f, last, paid), last)
    if best is None:
        return None, INF
    return best[1], best[0]
