# One image for the web server, the Celery worker and beat.
# The base is a build argument so a machine without access to Docker Hub can build on a local stand-in
# (tests/compose/override.yml does); everyone else gets the official image.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}

# The cache (the pinned llama.cpp source the console uploads to nodes) lives in the volume, fetched once.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 RAMDECK_VAR_DIR=/var/lib/ramdeck \
    RAMDECK_CACHE_DIR=/var/lib/ramdeck/cache
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-client iproute2 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ramdeck_site ramdeck_site
COPY nodes nodes
COPY jobs jobs
COPY deployments deployments
RUN pip install .
COPY . .
RUN mkdir -p /var/lib/ramdeck && DEBUG=0 RAMDECK_SECRET_KEY=build-only RAMDECK_ENCRYPTION_KEYS=$(python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())') \
    python manage.py collectstatic --noinput -v0
EXPOSE 8000
CMD ["sh", "-c", "python manage.py migrate --noinput && python manage.py ensure_admin && daphne -b 0.0.0.0 -p 8000 ramdeck_site.asgi:application"]
