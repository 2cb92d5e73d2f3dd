"""Forms of the model registry and the plan preview."""

from __future__ import annotations

from django import forms
from django.conf import settings as site_settings

from nodes.models import Device, Node
from planning import manual, planner


class PlanForm(forms.Form):
    """The settings of a plan preview. Unbound values fall back to the initial ones (a GET without query)."""

    # Each field's hint is one line in plain words; the help page (/help/) says more.
    coordinator = forms.ModelChoiceField(
        queryset=Node.objects.none(),
        required=False,
        help_text="The machine that runs the model's server and answers the chat; it holds the first blocks.",
    )
    nodes = forms.ModelMultipleChoiceField(
        queryset=Node.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="The machines that may lend their memory; the plan leaves out any that would slow it.",
    )
    ctx = forms.IntegerField(label="Context", min_value=256, max_value=1_048_576, initial=4096)
    # Past the model's trained context only when an admin insists (the field is shown to admins only).
    beyond = forms.BooleanField(
        label="I know, go beyond the trained context",
        required=False,
        help_text="The model has not learnt to use text that far back: answers get worse, and the memory "
        "is held all the same.",
    )
    parallel = forms.IntegerField(
        label="Parallel slots",
        min_value=1,
        max_value=64,
        initial=1,
        help_text="How many conversations it answers at once; they share the context. One suits a household.",
    )
    cache_type = forms.ChoiceField(
        label="KV cache",
        choices=[(k, k) for k in planner.KV_TYPES],
        initial="f16",
        help_text="The memory of the conversation so far: f16 exact, q8_0 half the memory, q4_0 a quarter.",
    )
    clamp = forms.FloatField(
        label="Unified-memory clamp", min_value=0.1, max_value=1.0,
        help_text="Share of a Mac's memory the plan may use (its CPU and GPU together); a lower wired "
        "limit set on the Mac wins.",
    )  # fmt: skip
    name = forms.CharField(
        max_length=200,
        required=False,
        help_text="Name of the deployment (optional; default: the model @ context).",
    )

    def __init__(
        self, *args, nodes_qs=None, coordinators_qs=None, trained_ctx: int = 0, may_go_beyond=False, **kwargs
    ):
        super().__init__(*args, **kwargs)
        # The context the model was trained for (0: the file does not say) caps the context; an admin may
        # tick `beyond` to go past it.
        self.trained_ctx = trained_ctx
        self.shows_beyond = bool(trained_ctx) and may_go_beyond
        self.fields["ctx"].help_text = "How much of the conversation it remembers, in tokens" + (
            f"; this model was trained for {trained_ctx:,}." if trained_ctx else "."
        )
        if not self.shows_beyond:
            del self.fields["beyond"]
        self.fields["nodes"].queryset = (
            nodes_qs if nodes_qs is not None else Node.objects.filter(enabled=True)
        )
        self.fields["coordinator"].queryset = (
            coordinators_qs if coordinators_qs is not None else Node.objects.filter(may_coordinate=True)
        )
        self.fields["clamp"].initial = site_settings.RAMDECK_UNIFIED_MEMORY_CLAMP
        # Each field names its error list (the page swaps the lists in after every recompute).
        for name, field in self.fields.items():
            field.widget.attrs["aria-describedby"] = f"errors-{name}"
        # The name goes with Confirm (its own POST form, after the evidence), not with the recompute.
        self.fields["name"].widget.attrs["form"] = "confirm-form"
        # A choice of one is no choice: the page shows the coordinator and the nodes as text then.
        self.shows_coordinator = self.fields["coordinator"].queryset.count() > 1
        self.shows_nodes = self.fields["nodes"].queryset.count() > 1
        # The clamp only matters to unified memory (Apple Silicon): the page shows it when the pool has some.
        self.shows_clamp = Device.objects.filter(
            node__in=self.fields["nodes"].queryset, unified_memory=True
        ).exists()

    def clean(self) -> dict:
        data = super().clean()
        ctx = data.get("ctx")
        if ctx and self.trained_ctx and ctx > self.trained_ctx and not data.get("beyond"):
            how = "tick “I know, go beyond” below" if self.shows_beyond else "only an admin may go beyond it"
            self.add_error(
                "ctx",
                f"This model was trained for {self.trained_ctx:,} tokens: give at most {self.trained_ctx} "
                f"({how}).",
            )
        return data

    def settings(self) -> planner.Settings:
        data = self.cleaned_data
        return planner.Settings(
            ctx=data["ctx"], parallel=data["parallel"], cache_type=data["cache_type"], clamp=data["clamp"]
        )


class ManualSplitForm(forms.Form):
    """A split by hand: one count of blocks per device (and, for a mixture of experts, one count of the
    blocks whose experts it holds), in the order the blocks run (planning/manual.py). Checked with the
    planner's own memory model: the counts add up to the model's blocks, every device stays within its
    memory, and no device its node's build does not offer holds anything. Each problem is a field error on
    the device's own field where it has one.

    `devices`: planning.manual.ManualDevice list; `problem`: the planner's Problem for the plan's inputs;
    `refusals`: device index -> why its node's build cannot run it (builds/offers.py)."""

    layout = forms.CharField(widget=forms.HiddenInput)

    def __init__(self, *args, problem, devices, refusals=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.problem = problem
        self.devices = list(devices)
        self.refusals = refusals or {}
        self.moe = manual.expert_blocks(problem) > 0
        self.n_blocks = len(problem.block_bytes)
        self.fields["layout"].initial = self.layout_key()
        for k, device in enumerate(self.devices):
            self.fields[f"layers_{k}"] = forms.IntegerField(
                label=f"{device.label}: blocks", min_value=0, max_value=10_000, initial=0
            )
            if self.moe:
                self.fields[f"experts_{k}"] = forms.IntegerField(
                    label=f"{device.label}: experts of blocks", min_value=0, max_value=10_000, initial=0
                )
        for name, field in self.fields.items():
            field.widget.attrs["aria-describedby"] = f"manual-errors-{name}"
        self.split = None
        self.evaluation = None
        self.needs: list[manual.DeviceNeed] = []

    def layout_key(self) -> str:
        """The devices, in order, as the page listed them: counts posted for another list are not taken."""
        return ",".join(f"{d.node}/{d.device}" for d in self.devices)

    def rows(self) -> list[dict]:
        """Per device, its fields and (once checked) what the split asks of it, for the template."""
        needs = {need.device.key: need for need in self.needs}
        return [
            {
                "device": d,
                "index": k,
                "layers": self[f"layers_{k}"],
                "experts": self[f"experts_{k}"] if self.moe else None,
                "need": needs.get(d.key),
            }
            for k, d in enumerate(self.devices)
        ]

    def counts(self) -> tuple[list[int], list[int] | None]:
        data = self.cleaned_data
        layers = [data[f"layers_{k}"] for k in range(len(self.devices))]
        experts = [data[f"experts_{k}"] for k in range(len(self.devices))] if self.moe else None
        return layers, experts

    def clean(self) -> dict:
        data = super().clean()
        if self.errors:
            return data
        if data.get("layout") != self.layout_key():
            raise forms.ValidationError(
                "The devices changed since the page was shown (a node's hardware or the plan's settings): "
                "look at the split again and enter it anew."
            )
        layers, experts = self.counts()
        for k, reason in self.refusals.items():
            held = layers[k] + (experts[k] if experts else 0)
            if held:
                self.add_error(f"experts_{k}" if not layers[k] else f"layers_{k}", reason)
        for error in manual.count_errors(self.problem, layers, experts):
            field = None if error.index is None else f"{error.count}_{error.index}"
            self.add_error(field, error.message)
        if self.errors:
            return data
        self.split = manual.manual_split(self.problem, self.devices, layers, experts)
        self.evaluation, self.needs = manual.device_needs(self.problem, self.devices, self.split)
        for k, need in enumerate(self.needs):
            if not need.fits:
                # The experts' field when the device holds at least as many blocks' experts as blocks: they
                # are most of what it holds.
                over_experts = experts is not None and experts[k] > 0 and experts[k] >= layers[k]
                self.add_error(
                    f"experts_{k}" if over_experts else f"layers_{k}", manual.over_memory_message(need)
                )
        if pool := manual.pool_message(self.problem, self.needs):
            self.add_error(None, pool)
        return data
