"""Forms of the model registry and the plan preview."""

from __future__ import annotations

from django import forms
from django.conf import settings as site_settings

from nodes.models import Device, Node
from planning import planner


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
