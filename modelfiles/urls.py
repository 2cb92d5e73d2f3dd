from __future__ import annotations

from django.urls import path

from modelfiles import views

app_name = "modelfiles"
urlpatterns = [
    path("", views.model_list, name="list"),
    path("<int:pk>/", views.model_detail, name="detail"),
    path("register/", views.model_register, name="register"),
    path("download/", views.model_download, name="download"),
    path("try-real/", views.model_try_real, name="try_real"),
    path("copy/", views.model_copy, name="copy"),
]
