from __future__ import annotations

from django.urls import path

from chat import views

app_name = "chat"
urlpatterns = [
    path("deployments/<int:pk>/chat/", views.deployment_chat, name="deployment"),
    path("deployments/<int:pk>/chat/page/", views.chat_page, name="page"),
]
