"""Forms of the model registry and the plan preview."""

from __future__ import annotations

from django import forms

from nodes.models import Node

from . import planner
from .models import ModelFile


class ModelRegisterForm(forms.Form):
    name = forms.CharField(max_length=200, help_text="How the console calls this model.")
    node = forms.ModelChoiceField(
        queryset=Node.objects.filter(enabled=True), help_text="The node that holds it."
    )
    path = forms.CharField(
        max_length=1000, help_text="Path of the GGUF file on that node (the first shard of a split model)."
    )

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if ModelFile.objects.filter(name=name).exists():
            raise forms.ValidationError("A model with this name is already registered.")
        return name

    def clean(self) -> dict:
        data = super().clean()
        if data.get("node") and data.get("path"):
            if not data["path"].startswith("/"):
                self.add_error("path", "Give an absolute path.")
            elif ModelFile.objects.filter(node=data["node"], path=data["path"]).exists():
                self.add_error("path", "This file is already registered on that node.")
        return data


class PlanForm(forms.Form):
    """The settings of a plan preview. Unbound values fall back to the initial ones (a GET without query)."""

    coordinator = forms.ModelChoiceField(queryset=Node.objects.none(), required=False)
    nodes = forms.ModelMultipleChoiceField(
        queryset=Node.objects.none(), required=False, widget=forms.CheckboxSelectMultiple
    )
    ctx = forms.IntegerField(label="Context", min_value=256, max_value=1_048_576, initial=4096)
    parallel = forms.IntegerField(label="Parallel slots", min_value=1, max_value=64, initial=1)
    cache_type = forms.ChoiceField(
        label="KV cache", choices=[(k, k) for k in planner.KV_TYPES], initial="f16"
    )
    clamp = forms.FloatField(
        label="Unified-memory clamp", min_value=0.1, max_value=1.0, initial=0.70,
        help_text="Share of a Mac's memory the plan may use.",
    )  # fmt: skip
    name = forms.CharField(max_length=200, required=False, help_text="Name of the deployment (optional).")

    def __init__(self, *args, nodes_qs=None, coordinators_qs=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["nodes"].queryset = (
            nodes_qs if nodes_qs is not None else Node.objects.filter(enabled=True)
        )
        self.fields["coordinator"].queryset = (
            coordinators_qs if coordinators_qs is not None else Node.objects.filter(may_coordinate=True)
        )

    def settings(self) -> planner.Settings:
        data = self.cleaned_data
        return planner.Settings(
            ctx=data["ctx"], parallel=data["parallel"], cache_type=data["cache_type"], clamp=data["clamp"]
        )
