from __future__ import annotations

from django.urls import path

from calibration import views

app_name = "calibration"
urlpatterns = [
    path("calibrate/", views.calibrate_all, name="all"),
    path("<slug:name>/calibrate/", views.calibrate_now, name="node"),
    path("<slug:name>/bandwidth/", views.bandwidth_override, name="figures"),
]
