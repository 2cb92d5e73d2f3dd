"""The body of the jobs app's own kind, `command`: one argument list run on a node.

Bodies of other kinds live in the apps that own them and are registered in their `AppConfig.ready()`
(jobs/kinds.py).
"""

from __future__ import annotations

from jobs.context import JobContext, JobFailed


async def run_command(ctx: JobContext) -> str:
    """Run the argument list in `job.params["argv"]` and succeed when it exits 0."""
    argv = ctx.job.params.get("argv")
    if not argv or not isinstance(argv, list) or not all(isinstance(arg, str) for arg in argv):
        raise JobFailed("This job has no command to run (params.argv must be a list of strings).")
    timeout = ctx.job.params.get("timeout")
    result = await ctx.run(argv, timeout=float(timeout) if timeout else None, check=True, capture=False)
    return f"{argv[0]} exited with status {result.exit_status}."
