"""The 500 page and the log line it points to.

Django logs an unhandled exception on `django.request`, but not one raised while an error page is rendered
(a 404 page that fails becomes a 500 whose log line says only "Not Found"). So the 500 view logs the
exception itself, with its traceback and a short reference that the page shows, on the console's log
(stderr: the terminal of `make run`, `docker compose logs web`); the filter below drops Django's own copy of
the same error, so each appears once.
"""

from __future__ import annotations

import logging
import secrets
import sys

from django.http import HttpResponseServerError
from django.template import loader
from django.views.decorators.csrf import requires_csrf_token

logger = logging.getLogger("ramdeck_site.errors")

# Set on the request once its error is logged here (the filter reads it from Django's log record).
LOGGED = "_ramdeck_error_logged"


@requires_csrf_token
def server_error(request, template_name: str = "500.html"):
    """handler500: log the exception being handled with a reference, and show the reference on the page.

    Rendered without a request context, as Django's own view does: the error may be in a context processor
    or the database."""
    reference = secrets.token_hex(4)
    exc_info = sys.exc_info()
    logger.error(
        "Server error %s: %s %s",
        reference,
        request.method,
        request.get_full_path(),
        exc_info=exc_info if exc_info[0] is not None else None,
    )
    setattr(request, LOGGED, True)
    html = loader.get_template(template_name).render({"reference": reference})
    return HttpResponseServerError(html)


class SkipLoggedServerErrors(logging.Filter):
    """On `django.request`: leave out the "Internal Server Error" line of a request whose error the 500
    view has logged already (with its reference)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(record, "request", None)
        status = getattr(record, "status_code", None)
        return not (status is not None and status >= 500 and getattr(request, LOGGED, False))
