"""Claims: a node's port or device held by one active deployment, enforced by a unique constraint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import models
from django.utils import timezone

from nodes.models import Node

if TYPE_CHECKING:
    from deployments.models.deployment import Deployment


class ClaimConflict(Exception):
    """A port or device of the plan is held by another active deployment. The message names it."""


class ClaimQuerySet(models.QuerySet):
    def active(self) -> ClaimQuerySet:
        """Claims of deployments that are active: the rows are deleted when a deployment stops or fails,
        and this keeps a row that outlived its deployment from counting."""
        # Imported here: deployments/models/deployment.py imports this module.
        from deployments.models.deployment import ACTIVE_STATES

        return self.filter(deployment__state__in=ACTIVE_STATES)


class ResourceClaim(models.Model):
    """A node's port or device held by one active deployment; the unique constraint is the guarantee.

    Rows are created in the transaction that moves a deployment to preparing and deleted when it stops
    or fails, so two active deployments can never hold the same (node, resource).
    """

    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="claims")
    # "port:50052" or "device:CUDA0".
    resource = models.CharField(max_length=60)
    deployment = models.ForeignKey("deployments.Deployment", on_delete=models.CASCADE, related_name="claims")
    created_at = models.DateTimeField(default=timezone.now)

    objects = ClaimQuerySet.as_manager()

    class Meta:
        ordering = ["node__name", "resource"]
        constraints = [
            models.UniqueConstraint(fields=["node", "resource"], name="unique_claim_per_node_resource")
        ]

    def __str__(self) -> str:
        return f"{self.node.name} {self.resource} → deployment #{self.deployment_id}"

    @staticmethod
    def wanted_by(deployment: Deployment) -> list[tuple[str, str]]:
        """(node name, resource) pairs the deployment's plan needs: every RPC port, llama-server's port, and
        every device that holds something."""
        plan = deployment.plan or {}
        wanted: set[tuple[str, str]] = {(deployment.coordinator.name, f"port:{deployment.port}")}
        for placement in plan.get("placements", []):
            node = placement.get("node")
            if not node:
                continue
            if placement.get("layers") or placement.get("output_layer"):
                wanted.add((node, f"device:{placement.get('device')}"))
            endpoint = placement.get("endpoint")
            if endpoint:
                wanted.add((node, f"port:{endpoint.rsplit(':', 1)[1]}"))
        return sorted(wanted)

    @classmethod
    def claim_for(cls, deployment: Deployment) -> None:
        wanted = cls.wanted_by(deployment)
        nodes = {n.name: n for n in Node.objects.filter(name__in={name for name, _ in wanted})}
        cls.objects.bulk_create(
            [
                cls(node=nodes[name], resource=res, deployment=deployment)
                for name, res in wanted
                if name in nodes
            ]
        )

    @classmethod
    def describe_conflicts(cls, deployment: Deployment) -> str:
        held = []
        for name, res in cls.wanted_by(deployment):
            claim = cls.objects.filter(node__name=name, resource=res).select_related("deployment").first()
            if claim and claim.deployment_id != deployment.pk:
                held.append(f"{res.replace(':', ' ')} on {name} is held by deployment {claim.deployment}")
        return "; ".join(held) or "a port or device of this plan is held by another active deployment"
