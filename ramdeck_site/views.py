from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpResponse


def dashboard(request):
    return HttpResponse("dashboard")


class RamdeckLoginView(auth_views.LoginView):
    pass


class RamdeckPasswordChangeView(auth_views.PasswordChangeView):
    pass


def logout_view(request):
    return HttpResponse("logout")


def password_change_done(request):
    return HttpResponse("done")
