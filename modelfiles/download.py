"""The `download` job (a GGUF model from a URL onto a node), and reading a model's profile on a node.

Reading a profile on a node (`read_model_profile`) is shared by the register view (a remote node, over SFTP)
and by the download job (any node): only the GGUF header of each shard is read, never the weights, through
`transport.read_head`; file sizes and the presence of the other shards come from one small shell command.
The headers are parsed in a child process with a memory and a time limit (llamacpp/gguf_isolated.py).

The download runs on the node: `curl --continue-at -` into `DEST.part` (so a failed or cancelled download
resumes where it stopped the next time; `DEST.part.url` records which URL the part belongs to, and a part
of another URL is discarded), with a progress line in the job log every few seconds; then the
optional SHA-256 check, `mv DEST.part DEST`, and the model is registered from its header. A file that is not
a usable model fails the job with the reason and registers nothing.

Job params: {"url" (shown: its query hidden), "url_secret" (the real URL, encrypted), "dest", "sha256" (may be
""), "name", "progress_every" (seconds, optional)}. The real URL is decrypted here and passed to curl only,
on its standard input (`curl --config -`: a command line is visible to every user of the node through
`ps`); logs and pages show `fetch_policy.redact_url`. A download writes at most RAMDECK_DOWNLOAD_MAX_BYTES
and starts only when the destination has room for what the server announces. Redirects are capped
(RAMDECK_DOWNLOAD_MAX_REDIRECTS). On the console's own host (a Local-transport node) the destination must lie
in a model folder and every hop of the redirect chain is resolved, checked (no loopback, link-local or
private address unless an admin allows the network) and fetched pinned to the checked address
(modelfiles/fetch_policy.py)."""

from __future__ import annotations

import asyncio
import posixpath
import re
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import IntegrityError, transaction

from audit import history
from jobs.aio import db
from jobs.context import JobFailed
from llamacpp import gguf as gguf_profile
from modelfiles import fetch_policy
from modelfiles.models import ModelFile, name_from_path
from modelfiles.register import PROFILE_TIMEOUT_S, file_sizes, mib, read_model_profile
from remote.base import TransportError, shell_join

if TYPE_CHECKING:
    from jobs.context import JobContext


PROGRESS_EVERY_S = 5


# curl's exit statuses that mean "the server cannot resume": start over without the part file.
CURL_CANNOT_RESUME = 33


CURL_HTTP_ERROR = 22


# curl's "larger than --max-filesize", and the download script's own "the part file passed the cap".
CURL_TOO_LARGE = 63


PASSED_THE_CAP = 90


# curl in the background, the size of the part file every `every` seconds while it runs, curl's status.
# $1 part file, $2 interval, $3 expected total bytes (or empty), $4 the most the part file may hold, then
# curl's argument list. curl reads its URL from the script's standard input (`--config -`): a background
# command's input is /dev/null unless redirected, hence fd 3. Past the cap (a server that did not announce
# its size, or lied about it) curl is stopped, checked every second, and the script exits 90.
_DOWNLOAD_SCRIPT = r"""
part=$1; every=$2; total=$3; cap=$4; shift 4
mib() { echo "$(($1 / 1048576)).$(($1 % 1048576 * 10 / 1048576))"; }
size() { if [ -f "$part" ]; then s=$(wc -c < "$part") && echo $s || echo 0; else echo 0; fi; }
report() {
  now=$(size)
  if [ -n "$total" ] && [ "$total" -gt 0 ]; then
    line="Downloaded $(mib "$now") MiB of $(mib "$total") MiB ($((now * 100 / total))%)"
  else
    line="Downloaded $(mib "$now") MiB"
  fi
  echo "$line$1"
}
passed() { report " (stopped: more than the $(mib "$cap") MiB a download may write)"; exit 90; }
start=$(size)
exec 3<&0
"$@" <&3 3<&- &
pid=$!
exec 3<&-
n=0; last=$start
while kill -0 "$pid" 2>/dev/null; do
  sleep 1; n=$((n + 1))
  if [ "$(size)" -gt "$cap" ]; then kill "$pid" 2>/dev/null; wait "$pid"; passed; fi
  if [ $((n % every)) -eq 0 ]; then
    now=$(size); report ", $(mib $(((now - last) / every))) MiB/s"; last=$now
  fi
done
wait "$pid"; status=$?
if [ "$(size)" -gt "$cap" ]; then passed; fi
report " (curl exit status $status)"
exit $status
"""


_SHA_RE = re.compile(r"^([0-9a-fA-F]{64})\b")


# `df -Pk`'s figures: 1024-blocks, used, available, capacity%.
_DF_RE = re.compile(r"\s(\d+)\s+(\d+)\s+(\d+)\s+\d+%\s")


_CONTENT_LENGTH_RE = re.compile(r"^content-length:\s*(\d+)\s*$", re.I | re.M)


def _size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{mib(size)} MiB"


def parse_sha256(text: str) -> str | None:
    """The hash from `sha256sum` / `shasum -a 256` output (its first line)."""
    match = _SHA_RE.match(text.strip())
    return match[1].lower() if match else None


def content_length(headers: str) -> int | None:
    """The size announced by the last response of `curl -sIL` (redirects print several header blocks)."""
    found = _CONTENT_LENGTH_RE.findall(headers.replace("\r", ""))
    return int(found[-1]) if found and int(found[-1]) > 0 else None


def curl_config(url: str) -> bytes:
    """`url = "..."` for `curl --config -`: the URL reaches curl on its standard input, never on its command
    line, where `ps` shows it (with the token of a signed link) to every user of the node. Quoted and escaped
    as curl's config parser reads it back, so no URL can end the line and add an option of its own."""
    escaped = url.replace("\\", "\\\\").replace('"', '\\"')
    for char, escape in (("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"), ("\v", "\\v")):
        escaped = escaped.replace(char, escape)
    if "\0" in escaped:  # Any other character curl's parser reads back as it is.
        raise JobFailed("The URL holds a NUL character; give the link exactly as the site shows it.")
    return f'url = "{escaped}"\n'.encode()


def curl_argv(part: str, *, pin: str | None = None, max_redirects: int | None = None) -> list[str]:
    """curl's arguments for the download; the URL comes on its standard input (`curl_config`). With `pin`
    (host:port:address, the console's own host) it follows no redirect: the chain was resolved and checked
    beforehand and the URL is its end."""
    if max_redirects is None:
        max_redirects = settings.RAMDECK_DOWNLOAD_MAX_REDIRECTS
    follow = ["--location", "--max-redirs", str(max_redirects)]
    if pin:
        follow = ["--resolve", pin, "--max-redirs", "0"]
    return [
        "curl",
        "--fail",
        *follow,
        "--no-progress-meter",
        "--continue-at",
        "-",
        # One URL, as given: brackets and braces are not curl's URL patterns.
        "--globoff",
        # Only web URLs, also after redirects (never file:// on the node).
        "--proto",
        "=http,https",
        "--proto-redir",
        "=http,https",
        "--retry",
        "3",
        "--connect-timeout",
        "30",
        # A transfer that stalls (under 1 byte/s for two minutes) fails rather than hangs.
        "--speed-limit",
        "1",
        "--speed-time",
        "120",
        # A size the server announces above the cap is refused before any byte (the job checked it too);
        # one it does not announce is watched by the download script.
        "--max-filesize",
        str(settings.RAMDECK_DOWNLOAD_MAX_BYTES),
        "--output",
        part,
        "--config",
        "-",
    ]


def shown_argv(argv: list[str], url: str) -> str:
    """The command line for the log, with the URL curl reads on its standard input (its query hidden)."""
    return f"{shell_join(argv)}  # url on standard input: {fetch_policy.redact_url(url)}"


_REDIRECT_CODES = {"301", "302", "303", "307", "308"}


_CONTENT_RANGE_RE = re.compile(r"^content-range:\s*bytes\s+\d+-\d+/(\d+)\s*$", re.I | re.M)


async def _checked_chain(ctx: JobContext, url: str) -> tuple[str, str, int | None]:
    """On the console's own host: follow the redirects one by one, each target resolved and checked before
    it is asked anything, each request pinned to the checked address. Returns (final URL, its pin, the size
    the final answer announced or None). A refused hop fails the job before any byte of it is fetched."""
    limit = settings.RAMDECK_DOWNLOAD_MAX_REDIRECTS
    for hop in range(limit + 1):
        try:
            host, port, address = await asyncio.to_thread(fetch_policy.checked_address, url)
        except fetch_policy.TargetRefused as exc:
            raise JobFailed(f"Download refused: {exc}") from None
        pin = fetch_policy.curl_resolve(host, port, address)
        # One byte of the body (a GET, as the download will be: a signed link may refuse HEAD); a server
        # that ignores the range is cut off by --max-filesize after its headers.
        probe = [
            "curl", "-sS", "--globoff", "--max-redirs", "0", "--proto", "=http,https", "--resolve", pin,
            "--range", "0-0", "--max-filesize", "1048576", "--max-time", "30", "--output", "/dev/null",
            "--dump-header", "-", "--write-out", "\n%{http_code} %{redirect_url}", "--config", "-",
        ]  # fmt: skip
        result = await ctx.transport.run(probe, timeout=60, input=curl_config(url))
        headers, _, status_line = result.stdout.rpartition("\n")
        code, _, target = status_line.strip().partition(" ")
        if code in _REDIRECT_CODES and target:
            if hop == limit:
                break
            shown = fetch_policy.redact_url(target)
            await ctx.log(f"Redirect {hop + 1} to {shown} (checked before it is followed).")
            url = target
            continue
        await ctx.log(f"{fetch_policy.redact_url(url)} answers from {address} (checked).")
        total = _CONTENT_RANGE_RE.findall(headers.replace("\r", ""))
        size = int(total[-1]) if total else (content_length(headers) if code == "200" else None)
        return url, pin, size
    raise JobFailed(f"Download refused: more than {limit} redirects (RAMDECK_DOWNLOAD_MAX_REDIRECTS).")


async def _announced_size(ctx: JobContext, url: str) -> int | None:
    """Content-Length from a HEAD request, for the percentages; servers that refuse HEAD just get none."""
    head = [
        "curl", "-sSIL", "--max-redirs", str(settings.RAMDECK_DOWNLOAD_MAX_REDIRECTS),
        "--globoff", "--proto", "=http,https", "--proto-redir", "=http,https", "--max-time", "30",
    ]  # fmt: skip
    try:
        result = await ctx.transport.run([*head, "--config", "-"], timeout=60, input=curl_config(url))
    except TransportError:  # The size is a nicety; the download itself reports real errors.
        return None
    return content_length(result.stdout) if result.ok else None


async def _download(
    ctx: JobContext, url: str, part: str, total: int | None, every: int, pin: str | None = None
) -> None:
    argv, cap = curl_argv(part, pin=pin), settings.RAMDECK_DOWNLOAD_MAX_BYTES
    for attempt in (1, 2):
        await ctx.log("$ " + shown_argv(argv, url))
        result = await ctx.run(
            ["sh", "-c", _DOWNLOAD_SCRIPT, "sh", part, str(every), str(total or ""), str(cap), *argv],
            check=False,
            echo=False,
            input=curl_config(url),
        )
        status = result.exit_status
        if status == 0:
            return
        if status in (PASSED_THE_CAP, CURL_TOO_LARGE):
            await ctx.run(["rm", "-f", "--", part, part + ".url"], echo=False)
            raise JobFailed(
                f"Download stopped: the file is larger than {_size(cap)}, the most a download may write "
                "(RAMDECK_DOWNLOAD_MAX_BYTES); what was downloaded is removed.",
                exit_code=status,
            )
        if status == CURL_CANNOT_RESUME and attempt == 1:
            await ctx.log("The server cannot resume a download; starting over.")
            await ctx.run(["rm", "-f", "--", part])
            continue
        if status == CURL_HTTP_ERROR and "error: 416" in result.stdout + _err_text(result):
            # 416 on a resume: the part file already holds the whole file (checked below like any other).
            await ctx.log("The server says the part file is already complete.")
            return
        tail = _err_text(result).strip().splitlines()
        reason = tail[-1] if tail else f"exit status {status}"
        [kept] = await file_sizes(ctx.transport, [part])
        if isinstance(kept, int) and kept > 0:
            reason += f". {mib(kept)} MiB are kept in {posixpath.basename(part)}; start it again to resume"
        raise JobFailed(f"Download failed: {reason}.", exit_code=status)


async def _claim_part(ctx: JobContext, url: str, part: str) -> None:
    """Resume only a part file of the same URL: a fingerprint of its URL is kept beside it (`DEST.part.url`;
    never the URL itself, whose query may hold a token). A part of another URL is removed, so two files are
    never spliced together."""
    origin = part + ".url"
    fingerprint = fetch_policy.url_fingerprint(url)
    [state] = await file_sizes(ctx.transport, [part])
    if state != "missing":
        try:
            previous = (await ctx.transport.read_head(origin, 65536)).decode("utf-8", "replace")
        except TransportError:
            previous = None  # No record: a part file someone put there; curl resumes it.
        if previous is not None and previous not in (fingerprint, url):
            await ctx.log(f"{part} holds a download of another URL; starting over.")
            await ctx.run(["rm", "-f", "--", part])
        elif isinstance(state, int) and state > 0:
            await ctx.log(f"Resuming after the {mib(state)} MiB already in {posixpath.basename(part)}.")
    await ctx.run(["sh", "-c", 'printf %s "$1" > "$2"', "sh", fingerprint, origin], echo=False)


async def _check_free_space(ctx: JobContext, part: str, total: int) -> None:
    """Refuse to start when the destination's file system cannot hold what is still to come."""
    folder = posixpath.dirname(part)
    [kept] = await file_sizes(ctx.transport, [part])
    needed = total - (kept if isinstance(kept, int) else 0)
    result = await ctx.transport.run(["df", "-Pk", "--", folder], timeout=30)
    lines = result.stdout.strip().splitlines()
    match = _DF_RE.search(lines[-1] + " ") if result.ok and lines else None
    if match is None:
        await ctx.log(f"Could not read the free space in {folder} (df exit status {result.exit_status}).")
        return
    free = int(match[3]) * 1024
    if needed > free:
        if not isinstance(kept, int):  # Nothing to resume later: no record of a part either.
            await ctx.run(["rm", "-f", "--", part + ".url"], echo=False)
        raise JobFailed(
            f"Download refused: it needs {_size(needed)} more in {folder} on {ctx.node.name}, which has "
            f"{_size(free)} free."
        )
    await ctx.log(f"{_size(free)} free in {folder}; the download needs {_size(needed)}.")


def _err_text(result) -> str:
    return "\n".join(line.text for line in result.lines if line.stream == "err")


async def _has(ctx: JobContext, tool: str) -> bool:
    # Exit 1, not the shell's 127 for "not found", which the transports report as an error of their own.
    script = 'command -v "$1" >/dev/null 2>&1 || exit 1'
    probe = await ctx.transport.run(["sh", "-c", script, "sh", tool], timeout=30)
    return probe.ok


async def _sha256_argv(ctx: JobContext, path: str) -> list[str]:
    if await _has(ctx, "sha256sum"):
        return ["sha256sum", "--", path]
    return ["shasum", "-a", "256", "--", path]  # macOS


async def _check_sha256(ctx: JobContext, part: str, expected: str) -> str:
    await ctx.log("Checking the SHA-256 of the download.")
    result = await ctx.run(await _sha256_argv(ctx, part), check=False)
    actual = parse_sha256(result.stdout)
    if not result.ok or actual is None:
        raise JobFailed(f"Could not compute the SHA-256 of {part} (exit status {result.exit_status}).")
    if actual != expected:
        await ctx.run(["rm", "-f", "--", part, part + ".url"])
        raise JobFailed(
            f"SHA-256 mismatch: expected {expected}, got {actual}. The downloaded file was removed."
        )
    await ctx.log(f"SHA-256 matches: {actual}")
    return actual


def _create_model(job, name: str, dest: str, profile: dict, sha256: str):
    try:
        with transaction.atomic():
            model = ModelFile.objects.create(
                name=name,
                node=job.node,
                path=dest,
                shard_paths=profile.pop("shard_paths", [dest]),
                size_bytes=profile.get("size_bytes", 0),
                sha256=sha256,
                profile=profile,
                created_by=job.created_by,
            )
            history.record(
                job.created_by,
                "model.register",
                model,
                changes={
                    "node": job.node.name,
                    "path": dest,
                    "architecture": profile["architecture"],
                    "job": job.pk,
                },
            )
    except IntegrityError:
        raise JobFailed(
            f"The file is downloaded to {dest}, but a model named {name!r} or with this path was registered "
            "meanwhile; register the file by path under another name."
        ) from None
    return model


async def download_body(ctx: JobContext) -> str:
    params = ctx.job.params
    url, dest = await db(fetch_policy.real_url)(params), params.get("dest", "")
    name, expected = params.get("name", "") or name_from_path(dest), (params.get("sha256") or "").lower()
    if not url or not dest.startswith("/"):
        raise JobFailed("This job has no URL or no absolute destination path.")
    local = ctx.node.is_local
    if local and (refusal := fetch_policy.local_dest_refusal(dest)):
        raise JobFailed(f"Download refused: {refusal}")
    every = max(1, int(params.get("progress_every") or PROGRESS_EVERY_S))
    part = dest + ".part"

    exists = await ctx.transport.run(["test", "-e", dest], timeout=30)
    if exists.ok:
        raise JobFailed(f"{dest} already exists on {ctx.node.name}; register it by path instead.")
    if not await _has(ctx, "curl"):
        raise JobFailed(f"curl is not installed on {ctx.node.name}; install it and start the download again.")
    pin = None
    if local:
        url, pin, total = await _checked_chain(ctx, url)
    await ctx.run(["mkdir", "-p", "--", posixpath.dirname(dest)])
    if local and (refusal := fetch_policy.local_dest_refusal(dest)):  # A symlink made meanwhile.
        raise JobFailed(f"Download refused: {refusal}")
    if not local:
        total = await _announced_size(ctx, url)
    cap = settings.RAMDECK_DOWNLOAD_MAX_BYTES
    if total:
        await ctx.log(f"The server announces {total} bytes ({mib(total)} MiB).")
        if total > cap:
            raise JobFailed(
                f"Download refused: the server announces {_size(total)}, more than the {_size(cap)} a "
                "download may write (RAMDECK_DOWNLOAD_MAX_BYTES)."
            )
    else:
        await ctx.log(f"The server does not announce the size; the download stops if it passes {_size(cap)}.")
    await _claim_part(ctx, url, part)
    if total:
        await _check_free_space(ctx, part, total)
    await _download(ctx, url, part, total, every, pin)
    sha256 = await _check_sha256(ctx, part, expected) if expected else ""
    await ctx.run(["mv", "-f", "--", part, dest])
    await ctx.run(["rm", "-f", "--", part + ".url"], echo=False)

    await ctx.log(f"Reading the GGUF header of {dest}.")
    try:
        profile = await asyncio.wait_for(read_model_profile(ctx.transport, dest), PROFILE_TIMEOUT_S)
    except gguf_profile.MissingShard as exc:
        # The file is fine, only its siblings are not there (yet): keep it for a later registration.
        raise JobFailed(f"Downloaded, not registered: {exc}") from None
    except gguf_profile.GGUFError as exc:
        await ctx.run(["rm", "-f", "--", dest])
        raise JobFailed(f"The download is not a usable model, so it was removed: {exc}") from None
    except TimeoutError:
        raise JobFailed(f"Reading the header of {dest} took longer than {PROFILE_TIMEOUT_S:g} s.") from None
    model = await db(_create_model)(ctx.job, name, dest, profile, sha256)
    return (
        f"Downloaded and registered {model.name}: {profile['architecture']}, "
        f"{profile['block_count']} blocks, {mib(profile['size_bytes'])} MiB."
    )
