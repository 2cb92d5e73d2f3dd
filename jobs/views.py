"""Job pages: the list, one job with its live log, the whole log as text, and cancel.

Live updates come over the websocket (jobs/consumers.py); each page also polls every 2 s while the job is
active and the socket is not open, and stops polling once the job has ended.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.handlers.asgi import ASGIRequest
from django.core.paginator import Paginator
from django.db.models import Prefetch, Q
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_POST

from audit import history
from jobs import broadcast
from jobs.broadcast import log_line_html, plain_text
from jobs.forms import JobFilterForm
from jobs.models import Job, JobLogLine, JobState, refuse_log
from ramdeck_site.roles import OPERATOR, VIEWER, role_required

# How many lines a job page shows at first, and per "load earlier lines".
TAIL_LINES = 500
# At most this many lines per polling answer (the next poll brings the rest).
POLL_LINES = 2000
DOWNLOAD_CHUNK = 5000


def _get_job(pk: int) -> Job:
    return get_object_or_404(Job.objects.select_related("node", "created_by"), pk=pk)


def _get_job_with_log(request: HttpRequest, pk: int) -> Job:
    """The job, when the user may read its log (jobs/models.py `may_read_log`), else a 403 that says why."""
    job = _get_job(pk)
    refuse_log(request, job)
    return job


def _int_param(request: HttpRequest, name: str) -> int | None:
    try:
        return int(request.GET[name])
    except (KeyError, ValueError):
        return None


def _grouped_jobs(form: JobFilterForm):
    """Top-level jobs (a deployment's run, a build, a command) with their steps, newest first.

    A filter matches a run when the run or one of its steps matches: filtering for failed reaps lists the
    runs those reaps belong to, each with all its steps."""
    match = Q()
    if form.is_valid():
        data = form.cleaned_data
        for field in ("state", "kind", "node_name"):
            value = data["node" if field == "node_name" else field]
            if value:
                match &= Q(**{field: value})
    runs = Job.objects.filter(parent__isnull=True)
    if match:
        runs = runs.filter(Q(pk__in=Job.objects.filter(match).values("parent_id")) | match)
    steps = Job.objects.select_related("created_by", "node").order_by("created_at", "pk")
    return runs.select_related("node", "created_by").prefetch_related(Prefetch("children", queryset=steps))


@role_required(VIEWER)
def job_list(request: HttpRequest) -> HttpResponse:
    form = JobFilterForm(request.GET or None)
    page = Paginator(_grouped_jobs(form), 50).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    context = {
        "filter_form": form,
        "page": page,
        "jobs": page.object_list,
        "any_active": any(
            job.is_active or any(step.is_active for step in job.children.all()) for job in page.object_list
        ),
        "query": query.urlencode(),
    }
    template = "jobs/job_list.html#table" if request.htmx else "jobs/job_list.html"
    return render(request, template, context)


@role_required(VIEWER)
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    job = _get_job_with_log(request, pk)
    after, before = _int_param(request, "after"), _int_param(request, "before")
    if request.htmx and after is not None:
        return _poll(request, job, after)
    lines = job.log_lines.all()
    if before is not None:
        lines = lines.filter(seq__lt=before)
    lines = list(reversed(lines.order_by("-seq")[:TAIL_LINES]))
    first_seq = lines[0].seq if lines else None
    context = {
        "job": job,
        "lines": lines,
        "first_seq": first_seq,
        "has_earlier": first_seq is not None and job.log_lines.filter(seq__lt=first_seq).exists(),
        # Only the tail connects live; a window of earlier lines (without htmx) is a still page.
        "is_tail": before is None,
        "last_seq": lines[-1].seq if lines else -1,
    }
    if request.htmx and before is not None:
        return render(request, "jobs/job_detail.html#earlier", context)
    return render(request, "jobs/job_detail.html", context)


def _poll(request: HttpRequest, job: Job, after: int) -> HttpResponse:
    """The polling fallback: the summary (which stops polling once the job ended) and the new lines."""
    rows = job.log_lines.filter(seq__gt=after).order_by("seq").values_list("seq", "stream", "text")
    lines_html = "".join(log_line_html(seq, stream, text) for seq, stream, text in rows[:POLL_LINES])
    context = {"job": job, "lines_html": mark_safe(lines_html), "job_id": job.pk}
    return render(request, "jobs/job_detail.html#poll", context)


@role_required(VIEWER)
def job_log_download(request: HttpRequest, pk: int) -> StreamingHttpResponse:
    """The whole log as plain text (ANSI codes stripped), streamed in chunks, never all in memory."""
    job = _get_job_with_log(request, pk)
    # Under ASGI (daphne) an async iterator streams; a sync one would be read whole into memory first.
    chunks = _log_chunks_async(job.pk) if isinstance(request, ASGIRequest) else _log_chunks(job.pk)
    response = StreamingHttpResponse(chunks, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="ramdeck-job-{job.pk}-{job.kind}.log"'
    return response


def _chunk_query(job_id: int, after: int):
    lines = JobLogLine.objects.filter(job_id=job_id, seq__gt=after).order_by("seq")
    return lines.values_list("seq", "text")[:DOWNLOAD_CHUNK]


def _as_text(rows) -> bytes:
    return "".join(plain_text(text) + "\n" for _, text in rows).encode()


def _log_chunks(job_id: int):
    last = -1
    while rows := list(_chunk_query(job_id, last)):
        yield _as_text(rows)
        last = rows[-1][0]


async def _log_chunks_async(job_id: int):
    last = -1
    while rows := [row async for row in _chunk_query(job_id, last)]:
        yield _as_text(rows)
        last = rows[-1][0]


@require_POST
@role_required(OPERATOR)
def job_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    job = _get_job(pk)
    if job.is_terminal:
        messages.info(request, f"{job} had already ended ({job.get_state_display().lower()}).")
    elif job.request_cancel():
        history.record(request, "job.cancel", job, changes={"state": job.state})
        if job.state == JobState.CANCELLED:
            # A queued job ends at once; a running one ends when its runner has stopped the process.
            broadcast.send_status_sync(job.pk, job.state, job.notify_groups)
            messages.success(request, f"{job} was cancelled before it started.")
        else:
            messages.success(request, f"Cancelling {job}: its process is being ended.")
    if request.htmx:
        job.refresh_from_db()
        return render(request, "jobs/job_detail.html#summary", {"job": job})
    return redirect(job)
