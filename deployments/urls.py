from __future__ import annotations

app_name = "deployments"
urlpatterns: list = []
