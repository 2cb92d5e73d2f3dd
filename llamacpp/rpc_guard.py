"""Who may reach a worker's ggml-rpc-server: nobody but the deployment's coordinator.

ggml-rpc-server has no authentication (upstream says never to expose it), so a deployment reaches it in
one of two ways, chosen per deployment (`Deployment.rpc_mode`) and allowed per node (`Node.rpc_tunnel`):

- **tunnel** (the default when every worker allows it): rpc-server binds 127.0.0.1 only; the coordinator
  runs `ssh -tt -L 127.0.0.1:LOCAL:127.0.0.1:PORT` toward the worker with a key pair generated for this
  deployment, whose `authorized_keys` entry on the worker allows that one forward and nothing else; `--rpc`
  points at the local ends. The forward is a process of the deployment like the others (PID recorded,
  checked by the monitor, ended by the stop steps, started again by a heal run); the entry is removed by
  the stop steps (stop, rollback, heal).
- **direct**: rpc-server binds the worker's LAN IPv4, normalised here (a hostname is resolved; `0`, `00`,
  `0x0` are what inet_aton makes of them: every interface, which only an admin may allow); where the SSH
  user may use sudo (or is root), an iptables rule tagged with the deployment rejects every source but the
  coordinator, removed by the stop steps.

Pure helpers (argument vectors, lines, tags); the steps that run them are deployments/steps/rpc_tunnel.py
and deployments/steps/llama_server.py. No Django imports.
"""

from __future__ import annotations

import ipaddress
import re
import socket

# Marks every file and command line of a tunnel: the reaper and the monitor know an ssh process as ours by it.
TUNNEL_MARK = "ramdeck-rpc-tunnel"
# The restrictions of a tunnel key on the worker: port forwarding to one port; no shell and no command of the
# client's choosing (the forced command only waits), no agent or X11 forwarding, no user rc; and only from the
# address the worker sees the coordinator come from (`from=`, learnt with DISCOVERY_OPTIONS). The pty is why
# the tunnel is fast: sshd turns Nagle's algorithm off (TCP_NODELAY) only for a session with a pty, and
# without it every RPC answer that ggml writes in two pieces waits for the coordinator's delayed ACK (~40 ms
# a token: tunnel decode measured 5-8x slower than direct with `ssh -N`, on par with it this way).
# Remote forwards (-R) are held to the same port: OpenSSH 9.2 refuses permitlisten="none" in a key's entry,
# and the rpc-server holds 127.0.0.1:PORT for as long as the key is there, so no listener can be opened.
# Unix-socket forwards are another matter: sshd applies permitopen to `-L` onto a socket (refused, checked in
# tests/llamacpp/test_rpc_guard.py) but no key option to `-R /path.sock:...` (remote_open_match() in OpenSSH's
# channels.c: "XXX add ACLs for streamlocal"), so only the worker's sshd_config can refuse those
# (`AllowStreamLocalForwarding no`); the tunnel step checks whether it does and says so (rpc_tunnel_step.py).
KEY_OPTIONS = (
    'restrict,from="{source}",port-forwarding,pty,permitopen="127.0.0.1:{port}",'
    'permitlisten="127.0.0.1:{port}",command="sleep 2147483647"'
)
# A tunnel key's first entry, for one login from the coordinator: no forwarding of any kind, no pty, and a
# forced command that prints the address sshd sees the client come from (SSH_CLIENT is "address port port").
# That address, not the console's idea of the coordinator's, is what `from=` must name: the worker may see
# the coordinator on another interface, through a VPN or a NAT, or by IPv6.
DISCOVERY_MARK = "ramdeck-source"
DISCOVERY_OPTIONS = f'restrict,command="echo {DISCOVERY_MARK} $SSH_CLIENT"'


class BindRefused(ValueError):
    """The address cannot be an rpc-server's bind address; the message says why and what to do."""


# --------------------------------------------------------------------------------------------------
# Direct mode: the address rpc-server binds
# --------------------------------------------------------------------------------------------------


def parse_ipv4(value: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address inet_aton (and so rpc-server) makes of `value`, or None when it is no IPv4 literal.

    `0`, `00`, `0x0`, `127.1`, `010.0.0.1` are all IPv4 addresses to inet_aton, not hostnames."""
    value = value.strip()
    if not value or not re.fullmatch(r"[0-9A-Fa-fXx.]+", value):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(value))
    except OSError:
        return None


def is_ipv6(value: str) -> bool:
    try:
        return ipaddress.ip_address(value.strip().strip("[]")).version == 6
    except ValueError:
        return False


def normalise_bind(value: str, *, allow_unspecified: bool = False, resolve=socket.getaddrinfo) -> str:
    """The dotted IPv4 address rpc-server should bind for `value` (an address or a hostname).

    Raises BindRefused for IPv6 (rpc-server listens on IPv4 only), a name that does not resolve to IPv4,
    and an unspecified address (every interface) unless an admin allowed it."""
    value = (value or "").strip()
    if not value:
        raise BindRefused("No address to bind ggml-rpc-server to.")
    if is_ipv6(value):
        raise BindRefused(
            f"{value} is an IPv6 address; ggml-rpc-server listens on IPv4 only. Give the node an IPv4 "
            "RPC bind address, or use tunnel mode (it binds 127.0.0.1)."
        )
    address = parse_ipv4(value)
    if address is None:
        try:
            infos = resolve(value, None, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise BindRefused(f"{value} does not resolve to an IPv4 address here ({exc}).") from None
        if not infos:
            raise BindRefused(f"{value} does not resolve to an IPv4 address here.")
        address = ipaddress.IPv4Address(infos[0][4][0])
    if address.is_unspecified and not allow_unspecified:
        raise BindRefused(
            f"{value} means every interface ({address}): the unauthenticated RPC server would be open to "
            "every network. Give the node's LAN address (only an admin may allow every interface)."
        )
    return str(address)


def binds_everywhere(value: str) -> bool:
    """Whether `value` (a node's RPC bind address) means every interface: 0.0.0.0 in any spelling, or ::."""
    value = (value or "").strip()
    if value.strip("[]") == "::":
        return True
    address = parse_ipv4(value)
    return address is not None and address.is_unspecified


# --------------------------------------------------------------------------------------------------
# Tunnel mode
# --------------------------------------------------------------------------------------------------


def tag_for(deployment_pk: int, node_name: str, console: str = "") -> str:
    """The comment on a deployment's authorized key and firewall rule on a node. `console` (the console's
    id, settings.RAMDECK_CONSOLE_ID) keeps two consoles that manage one node from writing the same tag."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", node_name)
    prefix = f"ramdeck-{re.sub(r'[^A-Za-z0-9_-]', '_', console)}-" if console else "ramdeck-"
    return f"{prefix}d{int(deployment_pk)}-{name}"


def new_key_pair(comment: str) -> tuple[str, str]:
    """(private key in OpenSSH format, public key line) of a fresh Ed25519 key (asyncssh's generator)."""
    # Imported here: asyncssh (and the cryptography library under it) is heavy, and the planner and the
    # log parsers that share this package never need it.
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    private = key.export_private_key("openssh").decode()
    public = key.export_public_key("openssh").decode().strip()
    return private, public


def source_pattern(address: str) -> str:
    """The `from=` value for the coordinator's address as the worker's sshd sees it: one IP address, written
    as sshd writes it (a name would need UseDNS, which is off by default; a pattern could admit others)."""
    try:
        ip = ipaddress.ip_address((address or "").strip())
    except ValueError:
        raise ValueError(f"{address!r} is not an IP address; a tunnel key's from= needs one") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # sshd reports a v4 client on a dual-stack socket as plain IPv4
    return str(ip)


def authorized_line(public_key: str, port: int, tag: str, source: str) -> str:
    """The worker's authorized_keys entry: this key may forward to 127.0.0.1:PORT, from the coordinator's
    address only, and do nothing else."""
    kind, blob = public_key.split()[:2]
    return f"{KEY_OPTIONS.format(port=int(port), source=source_pattern(source))} {kind} {blob} {tag}"


def discovery_line(public_key: str, tag: str) -> str:
    """The tunnel key's first entry: one login that learns the coordinator's address (DISCOVERY_OPTIONS)."""
    kind, blob = public_key.split()[:2]
    return f"{DISCOVERY_OPTIONS} {kind} {blob} {tag}"


def parse_source(output: str) -> str | None:
    """The client address from the discovery login's output, or None when the output has none."""
    for line in output.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == DISCOVERY_MARK:
            try:
                return source_pattern(words[1])
            except ValueError:
                return None
    return None


# Edits of authorized_keys, one script for adding, replacing and removing a line, so every edit takes the
# same lock: flock(1) on the file itself where there is one (Linux), else a lock folder beside it (macOS
# has no flock command), taken over when the shell that made it is gone. Under the lock: a last line without
# its newline gets one first (ours would otherwise run into it, and go with it on removal); the line to
# remove goes by exact comparison of the whole line (awk reads it from the environment: `-v` would expand
# backslashes); the file is rewritten in place, so its owner, mode and inode (the lock) stay.
_EDIT_SCRIPT = r"""
lock() {
  if command -v flock >/dev/null 2>&1; then
    flock -w 60 9 || { echo "could not lock $1 within 60 s" >&2; exit 75; }
    return
  fi
  lockdir="$1.ramdeck-lock"
  i=0
  until mkdir "$lockdir" 2>/dev/null; do
    holder=$(cat "$lockdir/pid" 2>/dev/null)
    if [ -n "$holder" ] && ! kill -0 "$holder" 2>/dev/null && mkdir "$lockdir.break" 2>/dev/null; then
      # Its holder is gone. Taken over only if it still names that holder: it may have been freed and
      # taken by another since it was read, and one taking-over at a time (the .break folder) sees that.
      [ "$(cat "$lockdir/pid" 2>/dev/null)" = "$holder" ] && rm -rf "$lockdir"
      rmdir "$lockdir.break"
      continue
    fi
    i=$((i + 1))
    if [ "$i" -ge 600 ]; then
      echo "could not lock $1 within 60 s (remove $lockdir if nothing edits it)" >&2; exit 75
    fi
    sleep 0.1
  done
  echo $$ > "$lockdir/pid"
  trap 'rm -rf "$lockdir"' EXIT
}
umask 077
if [ -z "$3" ] && [ ! -f "$1" ]; then exit 0; fi
mkdir -p "$(dirname "$1")" && exec 9>>"$1" || exit 1
lock "$1"
if [ -n "$2" ] && grep -qxF -e "$2" "$1"; then
  t="$1.ramdeck-$$"
  RAMDECK_LINE="$2" awk '$0 != ENVIRON["RAMDECK_LINE"]' "$1" > "$t" && cat "$t" > "$1"
  s=$?; rm -f "$t"; [ "$s" -eq 0 ] || exit "$s"
fi
if [ -n "$3" ]; then
  if [ -s "$1" ] && [ -n "$(tail -c 1 "$1")" ]; then printf '\n' >&9; fi
  grep -qxF -e "$3" "$1" || printf '%s\n' "$3" >&9
fi
"""


def edit_lines_argv(path: str, *, remove: str = "", add: str = "") -> list[str]:
    """Remove the line `remove` (exactly that line, every copy) from `path` and append `add`, under the
    file's lock; either may be "". The file and its folder are created 0600/0700 when missing."""
    for line in (remove, add):
        if "\n" in line or "\r" in line:
            raise ValueError("an authorized_keys entry is one line")
    return ["sh", "-c", _EDIT_SCRIPT, "ramdeck-authorize", path, remove, add]


def remove_line_argv(path: str, line: str) -> list[str]:
    """Remove exactly `line` from `path` under the file's lock, keeping the file (its owner and mode)."""
    return edit_lines_argv(path, remove=line)


def remove_tagged_argv(path: str, tag: str) -> list[str]:
    """Remove from `path` every line whose last word is `tag`, keeping the file (its owner and mode).

    Only for guards recorded before the exact line was (deployments started by an older console): a tag
    without the console's id may also be another console's."""
    script = (
        '[ -f "$1" ] || exit 0; t="$1.ramdeck-$$"; '
        'awk -v tag="$2" \'$NF != tag\' "$1" > "$t" && cat "$t" > "$1"; s=$?; rm -f "$t"; exit $s'
    )
    return ["sh", "-c", script, "ramdeck-unauthorize", path, tag]


def _ssh_options(known_hosts: str, alias: str) -> list[str]:
    """The pinned host key only, the given key only, no prompt, no shared connection."""
    options = {
        "IdentitiesOnly": "yes",
        "BatchMode": "yes",
        "HostKeyAlias": alias,
        "UserKnownHostsFile": known_hosts,
        "GlobalKnownHostsFile": "/dev/null",
        "StrictHostKeyChecking": "yes",
        "ControlMaster": "no",
        "ControlPath": "none",
    }
    return [arg for name, value in options.items() for arg in ("-o", f"{name}={value}")]


def discovery_argv(
    *, key_path: str, known_hosts: str, alias: str, user: str, address: str, ssh_port: int
) -> list[str]:
    """The coordinator's one login with the tunnel key's discovery entry (see DISCOVERY_OPTIONS)."""
    argv = ["ssh", "-T", "-F", "/dev/null", "-i", key_path, *_ssh_options(known_hosts, alias)]
    return [*argv, "-o", "ConnectTimeout=15", "-p", str(int(ssh_port)), "-l", user, address]


def forward_argv(
    *,
    key_path: str,
    known_hosts: str,
    alias: str,
    local_port: int,
    port: int,
    user: str,
    address: str,
    ssh_port: int,
) -> list[str]:
    """The coordinator's `ssh -tt -L` to a worker's rpc-server: no config file, the pinned host key only,
    this deployment's key only, no prompt, and it exits when the forward cannot be set up or the link dies.
    `-tt` asks for the pty that makes sshd send without delay (see KEY_OPTIONS); the worker runs its forced
    command, which only waits, and ends with the connection."""
    argv = ["ssh", "-tt", "-F", "/dev/null", "-i", key_path, *_ssh_options(known_hosts, alias)]
    for name, value in (
        ("ExitOnForwardFailure", "yes"),
        ("ServerAliveInterval", "15"),
        ("ServerAliveCountMax", "3"),
    ):
        argv += ["-o", f"{name}={value}"]
    argv += ["-L", f"127.0.0.1:{int(local_port)}:127.0.0.1:{int(port)}", "-p", str(int(ssh_port))]
    return [*argv, "-l", user, address]


def tunnel_rpc_args(args: list[str], local_ends: dict[str, str]) -> list[str]:
    """llama-server's arguments with each planned `--rpc` endpoint replaced by its tunnel's local end, in
    `--rpc` and in the RPC buffer names of `-ot` rules (`RPC0[host:port]`, a mixture of experts' experts
    placed apart): llama.cpp names an RPC buffer after the endpoint it connected to, and refuses a rule
    whose buffer does not exist."""
    args = list(args)
    if "--rpc" in args:
        at = args.index("--rpc") + 1
        args[at] = ",".join(local_ends.get(e, e) for e in args[at].split(","))
    for at in range(len(args) - 1):
        if args[at] in ("-ot", "--override-tensor"):
            for endpoint, local in local_ends.items():
                args[at + 1] = args[at + 1].replace(f"[{endpoint}]", f"[{local}]")
    return args


def planned_endpoints_in(log_text: str, local_ends: dict[str, str]) -> str:
    """llama-server's log with each tunnel's local end named by its planned endpoint again (RPC0[...])."""
    for endpoint, local in local_ends.items():
        log_text = log_text.replace(f"[{local}]", f"[{endpoint}]")
    return log_text


# --------------------------------------------------------------------------------------------------
# Direct mode: the firewall rule
# --------------------------------------------------------------------------------------------------


def firewall_rule(port: int, coordinator: str, tag: str) -> list[str]:
    """An INPUT rule (iptables syntax after the chain): TCP to PORT from anyone but the coordinator is
    refused (a reset, so a client learns at once)."""
    return [
        "-p",
        "tcp",
        "--dport",
        str(int(port)),
        "!",
        "-s",
        f"{ipaddress.IPv4Address(coordinator)}/32",
        "-m",
        "comment",
        "--comment",
        tag,
        "-j",
        "REJECT",
        "--reject-with",
        "tcp-reset",
    ]


def iptables_argv(action: str, rule: list[str], *, sudo: bool) -> list[str]:
    return [*(["sudo", "-n"] if sudo else []), "iptables", "-w", action, "INPUT", *rule]


def sudo_allows_argv(action: str, rule: list[str]) -> list[str]:
    """Whether sudo lets this user run exactly `iptables -w ACTION INPUT RULE` without a password: `sudo -l`
    with a command checks that one command line against the sudoers rules and runs nothing (exit 0: allowed).
    Asking `sudo -n true` instead would refuse a user whose sudoers line allows only these commands
    (SUDOERS_LINE) and accept one who may not run iptables at all."""
    return ["sudo", "-n", "-l", "iptables", "-w", action, "INPUT", *rule]


# The sudoers line that lets the SSH user run the console's iptables commands and nothing else: inserting and
# deleting its REJECT rule on the node's RPC port, for one IPv4 address and a tag of ours (sudo 1.9.10 or
# newer reads an argument list between ^ and $ as a regular expression). `!` is escaped as sudoers requires.
SUDOERS_LINE = (
    "{user} ALL=(root) NOPASSWD: {iptables} "
    "^-w -[ID] INPUT -p tcp --dport {port} \\! -s [0-9.]+/32 -m comment --comment ramdeck-[A-Za-z0-9_-]+ "
    "-j REJECT --reject-with tcp-reset$"
)


def sudoers_line(user: str, port: int, iptables: str = "/usr/sbin/iptables") -> str:
    """SUDOERS_LINE for one SSH user and RPC port (the node's iptables path, as `command -v iptables`
    prints it for root)."""
    return SUDOERS_LINE.format(user=user, port=int(port), iptables=iptables)


def calibration_tag(job_pk: int, node_name: str) -> str:
    """The comment on the firewall rule a calibration puts in front of its link measurement."""
    return f"ramdeck-c{int(job_pk)}-{re.sub(r'[^A-Za-z0-9_-]', '_', node_name)}"
