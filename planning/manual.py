"""A split given by hand: how many blocks (and, for a mixture of experts, how many blocks' experts) each
device holds, turned into the planner's own `Split` and priced and checked with its own model.

Pure Python, no Django. When the plan is wrong (a GPU the probe cannot see, a model the speed model gets
wrong) an operator says "these layers on that device"; the console then holds that split to the same memory
model the planner uses (planning/costs.py `evaluate`), so a split that would not fit is refused before
anything starts, and shows its predicted speed beside the planner's.

The counts follow llama.cpp's placement: the coordinator's CPU holds the first blocks, each other device the
next run of blocks in the order given, and the last device with blocks the output layer as well. A mixture of
experts' routed experts stay with their block unless a device is given the experts of more or fewer blocks
than it holds: then each device keeps the experts of its last blocks and the others go, in block order, to
the devices that take some in (planning/experts.py `assign_split`, the rule the planner's own search uses,
so the planner's split is one the form can state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planning.cluster import GIB, MIB
from planning.costs import EXPERTS_ON_CPU, Evaluation, Part, Problem, Split, evaluate
from planning.experts import assign_split


@dataclass(frozen=True)
class ManualDevice:
    """One device a split by hand may use: `key` is EXPERTS_ON_CPU for the coordinator's CPU, else the
    problem's slot index."""

    key: int
    node: str
    device: str
    kind: str

    @property
    def label(self) -> str:
        return f"{self.node} / {self.device}"


@dataclass(frozen=True)
class CountError:
    """A problem with the counts: which device (its index in the device list, None for the split as a whole),
    which count ("layers" or "experts"), and what is wrong, in words."""

    index: int | None
    count: str
    message: str


def manual_devices(problem: Problem, preferred: Sequence[tuple[str, str]] = ()) -> list[ManualDevice]:
    """The devices, in the order their blocks run: the coordinator's CPU first (llama.cpp keeps the first
    blocks there), then those of `preferred` (node, device) pairs, the plan's own order, then the rest."""
    cpu = problem.cpu
    out = [ManualDevice(EXPERTS_ON_CPU, cpu.node.name, cpu.device.name, cpu.device.kind)]
    by_name = {(s.node.name, s.device.name): i for i, s in enumerate(problem.slots)}
    keys = [by_name[pair] for pair in preferred if pair in by_name]
    keys = list(dict.fromkeys(keys)) + [i for i in range(len(problem.slots)) if i not in keys]
    for i in keys:
        slot = problem.slots[i]
        out.append(ManualDevice(i, slot.node.name, slot.device.name, slot.device.kind))
    return out


def expert_blocks(problem: Problem) -> int:
    """How many blocks have routed experts (0: a dense model, whose split has no experts to place)."""
    return sum(1 for e in problem.expert_bytes if e)


def _count_errors(total_name: str, what: str, values: Sequence[int], n: int, count: str) -> list[CountError]:
    errors = [
        CountError(k, count, f"The model has {n} {what}: no device can hold {v}.")
        for k, v in enumerate(values)
        if v > n
    ]
    if errors:
        return errors
    total = sum(values)
    if total > n:
        last = max(k for k, v in enumerate(values) if v)
        errors.append(
            CountError(last, count, f"That makes {total} {what}, {total - n} more than the model has ({n}).")
        )
    elif total < n:
        left = n - total
        errors.append(
            CountError(
                None,
                count,
                f"{left} of the model's {n} {what} {'is' if left == 1 else 'are'} on no device yet: "
                f"the {total_name} must add up to {n}.",
            )
        )
    return errors


def count_errors(
    problem: Problem, layers: Sequence[int], experts: Sequence[int] | None = None
) -> list[CountError]:
    """What is wrong with the counts themselves, before any memory is looked at: a count past the model's
    blocks, or counts that do not add up to them (saying how many are over or left)."""
    n = len(problem.block_bytes)
    errors = _count_errors("layers", "blocks", layers, n, "layers")
    if experts is not None:
        errors += _count_errors("experts", "blocks with experts", experts, expert_blocks(problem), "experts")
    return errors


def _home(split: Split) -> list[int]:
    keys = [(EXPERTS_ON_CPU, split.cpu_blocks), *zip(split.order, split.counts, strict=True)]
    return [key for key, count in keys for _ in range(count)]


def manual_split(
    problem: Problem,
    devices: Sequence[ManualDevice],
    layers: Sequence[int],
    experts: Sequence[int] | None = None,
) -> Split:
    """The `Split` for counts per device (in `devices` order; counts that `count_errors` accepts). Without
    `experts`, or when every device holds the experts of exactly its own blocks, the experts stay with their
    blocks and the split carries no `-ot` placement, as the planner's own dense search gives it."""
    if len(layers) != len(devices) or (experts is not None and len(experts) != len(devices)):
        raise ValueError("One count per device is needed.")
    if not devices or devices[0].key != EXPERTS_ON_CPU:
        raise ValueError("The coordinator's CPU comes first.")
    moe = [bool(e) for e in problem.expert_bytes]
    if experts is None:
        # Each device holds the experts of its own blocks.
        experts, start = [], 0
        for count in layers:
            experts.append(sum(moe[start : start + count]))
            start += count
    picks = [(d.key, layers[k], experts[k]) for k, d in enumerate(devices) if k > 0]
    with_blocks = [d.key for k, d in enumerate(devices) if k > 0 and layers[k] > 0]
    split = assign_split(problem, (layers[0], experts[0]), picks, with_blocks[-1] if with_blocks else None)
    if split.experts == _home(split):
        split.experts = None
    return split


@dataclass(frozen=True)
class DeviceNeed:
    """What a split asks of one device: the bytes it would use, what it may use (capacity, after the safety
    margin) and its free memory (the limit the margin is taken from)."""

    device: ManualDevice
    used_bytes: int
    capacity_bytes: int
    limit_bytes: int
    part: Part | None

    @property
    def fits(self) -> bool:
        return self.used_bytes <= self.capacity_bytes


def device_needs(
    problem: Problem, devices: Sequence[ManualDevice], split: Split
) -> tuple[Evaluation, list[DeviceNeed]]:
    """The split priced by `evaluate` and what it asks of every device, in `devices` order."""
    evaluation = evaluate(problem, split)
    parts = {id(p.slot): p for p in evaluation.parts}
    needs = []
    for d in devices:
        slot = problem.cpu if d.key == EXPERTS_ON_CPU else problem.slots[d.key]
        part = parts.get(id(slot))
        used = part.used_bytes if part is not None else 0
        needs.append(DeviceNeed(d, used, slot.capacity, slot.limit, part))
    return evaluation, needs


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def over_memory_message(need: DeviceNeed) -> str:
    """The refusal for a device the split puts over its memory: the device, its need and its free memory."""
    part = need.part
    detail = (
        f" (weights {size(part.weights)}, KV cache {size(part.kv)}, compute buffer {size(part.compute)})"
        if part is not None
        else ""
    )
    return (
        f"{need.device.label} would need {size(need.used_bytes)}{detail}, but has {size(need.limit_bytes)} "
        f"free: {size(need.capacity_bytes)} after the safety margin."
    )


def pool_message(problem: Problem, needs: Sequence[DeviceNeed]) -> str:
    """The refusal when the coordinator's CPU and its unified GPU together exceed their shared pool, or ""."""
    if problem.pool_slot is None:
        return ""
    gpu = problem.slots[problem.pool_slot]
    used = sum(n.used_bytes for n in needs if n.device.key in (EXPERTS_ON_CPU, problem.pool_slot))
    if used <= problem.pool_capacity:
        return ""
    return (
        f"{problem.coordinator.name}'s CPU and {gpu.device.name} share one unified memory: together they "
        f"would need {size(used)}, but may use {size(problem.pool_capacity)}."
    )
