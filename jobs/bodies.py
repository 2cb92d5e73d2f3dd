"""What each kind of job does. The runner looks the body up here by `job.kind`.

A body is `async def body(ctx: JobContext) -> str`: it acts on the node through `ctx.run`,
`ctx.start_daemon` and `ctx.transport`, writes progress with `ctx.log`, raises `JobFailed(reason)` when the
work ran but did not succeed, and returns one line for the job's result. Bodies of other apps are named
by dotted path, so importing this module never imports them (and their own imports stay lazy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import JobContext

# kind -> dotted path of its body. Other apps add their kinds here.
BODIES: dict[str, str] = {
    "command": "jobs.bodies.run_command",
    "probe": "nodes.probe_job.probe",
    "build": "deployments.build_job.build_body",
    "reap": "deployments.lifecycle_steps.reap_body",
    "launch": "deployments.lifecycle_steps.launch_body",
    "stop": "deployments.lifecycle_steps.stop_body",
    "download": "deployments.download_job.download_body",
    "calibrate": "deployments.calibrate_job.calibrate_body",
}


async def run_command(ctx: JobContext) -> str:
    """Run the argument list in `job.params["argv"]` and succeed when it exits 0."""
    from .runner import JobFailed

    argv = ctx.job.params.get("argv")
    if not argv or not isinstance(argv, list) or not all(isinstance(arg, str) for arg in argv):
        raise JobFailed("This job has no command to run (params.argv must be a list of strings).")
    timeout = ctx.job.params.get("timeout")
    result = await ctx.run(argv, timeout=float(timeout) if timeout else None, check=True, capture=False)
    return f"{argv[0]} exited with status {result.exit_status}."
