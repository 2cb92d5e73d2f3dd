from __future__ import annotations

app_name = "jobs"
urlpatterns: list = []
