"""Deployments (a confirmed plan and everything that happened to it since), the ports and devices they
claim, the jobs of their runs, the stale processes the monitor finds and the speed it samples."""

from deployments.models.claims import ClaimConflict, ResourceClaim
from deployments.models.deployment import (
    ACTIVE_STATES,
    REDEPLOYABLE_STATES,
    SPEED_ERROR_LIMIT,
    TERMINAL_STATES,
    Deployment,
    DeploymentState,
    RpcMode,
)
from deployments.models.monitoring import SpeedSample
from deployments.models.steps import DeploymentStep, StaleProcess

__all__ = [
    "ACTIVE_STATES",
    "REDEPLOYABLE_STATES",
    "SPEED_ERROR_LIMIT",
    "TERMINAL_STATES",
    "ClaimConflict",
    "Deployment",
    "DeploymentState",
    "DeploymentStep",
    "ResourceClaim",
    "RpcMode",
    "SpeedSample",
    "StaleProcess",
]
