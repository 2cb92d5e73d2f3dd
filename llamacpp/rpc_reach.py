"""Does the coordinator itself reach a worker's ggml-rpc-server, and how far away is it? Asked on the
coordinator, not from the console: the console may sit on another network (a NAS, a laptop), and what
llama-server will need is the coordinator's own path to each worker, through whatever firewall or tunnel
lies between them.

`reach_argv` is a small RPC client run on the coordinator with perl (on stock macOS and in every Linux
distribution's base system; no compiler, no Python needed): it times the TCP connect (one network round
trip), says HELLO (so a tunnel's local end counts only when the far side answers: an `ssh -L` accepts the
connection on the coordinator whatever happens beyond it), and times a few GET_DEVICE_MEMORY requests, the
smallest request the server answers at once (what every decode step pays per worker). A first connection,
closed at once, is not timed: it pays for perl loading its socket code. Formats as in
llamacpp/rpc_wire.py. `parse_reach` reads its one line; `firewall_fix` is the command, in the worker
OS's own words, that lets the coordinator in. No Django imports here.
"""

from __future__ import annotations

import ipaddress
import shlex
import statistics
from dataclasses import dataclass

from llamacpp.rpc_wire import CMD_GET_DEVICE_MEMORY, CMD_HELLO, CONN_CAPS_SIZE, PROTOCOL_MAJOR

# Prints one line: "ok CONNECT_MS HELLO_MS MAJOR.MINOR.PATCH PING_MS,PING_MS,..." or "fail STAGE REASON".
# Sizes are 64-bit little-endian, packed as two 32-bit halves so that a 32-bit perl runs it too.
_CLIENT = f"""
use strict; use IO::Socket::INET;
our $coarse; BEGIN {{ eval {{ require Time::HiRes; Time::HiRes->import('time'); 1 }} or $coarse = 1 }}
my ($host, $port, $pings, $wait) = @ARGV; $| = 1;
sub fail {{ my $why = join(' ', @_); $why =~ s/\\s+/ /g; print "fail $why\\n"; exit 0 }}
$SIG{{ALRM}} = sub {{ fail('answer', "no answer within $wait s") }};
sub open_one {{
  my $s = IO::Socket::INET->new(PeerAddr => $host, PeerPort => $port, Proto => 'tcp', Timeout => $wait);
  return $s if $s;
  my $why = $@ || "$!" || 'failed'; $why =~ s/^.*connect: //;
  $why = 'Connection timed out' if $why eq 'timeout';
  fail('connect', $why) }}
close open_one();
my $t0 = time; my $s = open_one(); my $connect = (time - $t0) * 1000;
setsockopt($s, 6, 1, 1);
sub readn {{ my ($n) = @_; my $buf = '';
  while (length($buf) < $n) {{
    my $r = sysread($s, $buf, $n - length($buf), length($buf)); return undef unless $r; }}
  return $buf }}
sub call {{ my ($cmd, $payload) = @_; alarm $wait;
  syswrite($s, pack('C', $cmd) . pack('V2', length($payload), 0) . $payload) or return undef;
  my $head = readn(8); return undef unless defined $head;
  my ($size, $high) = unpack('V2', $head); return undef if $high || $size > 4096;
  my $body = readn($size); alarm 0; return $body }}
my $t1 = time;
my $hello = call({CMD_HELLO}, "\\0" x {CONN_CAPS_SIZE});
fail('hello', 'the connection was closed without an RPC answer') unless defined $hello && length($hello) >= 3;
my $hello_ms = (time - $t1) * 1000;
my ($major, $minor, $patch) = unpack('C3', $hello);
my @times;
if ($major == {PROTOCOL_MAJOR}) {{
  for (1 .. $pings) {{ my $t = time;
    defined call({CMD_GET_DEVICE_MEMORY}, pack('V', 0)) or fail('ping', 'the server stopped answering');
    push @times, sprintf('%.3f', (time - $t) * 1000) }}
}}
close $s;
if ($coarse) {{ printf "ok - - %d.%d.%d -\\n", $major, $minor, $patch; exit 0 }}
printf "ok %.3f %.3f %d.%d.%d %s\\n", $connect, $hello_ms, $major, $minor, $patch, join(',', @times) || '-';
"""

# Prints "ok MS,MS,..." (each a TCP handshake's time) or "fail connect REASON". For a link that no RPC
# server listens on yet (a calibration's coordinator–worker pairs): the worker's sshd port answers the
# handshake whatever the login would be, and one handshake is one network round trip.
_HANDSHAKES = """
use strict; use IO::Socket::INET;
our $coarse; BEGIN { eval { require Time::HiRes; Time::HiRes->import('time'); 1 } or $coarse = 1 }
my ($host, $port, $samples, $wait) = @ARGV; $| = 1; my @times;
for my $i (0 .. $samples) {
  my $t = time;
  my $s = IO::Socket::INET->new(PeerAddr => $host, PeerPort => $port, Proto => 'tcp', Timeout => $wait);
  if (!$s) { my $why = $@ || "$!" || 'failed'; $why =~ s/^.*connect: //; $why =~ s/\\s+/ /g;
    $why = 'Connection timed out' if $why eq 'timeout'; print "fail connect $why\n"; exit 0 }
  my $ms = (time - $t) * 1000; close $s;
  push @times, sprintf('%.3f', $ms) if $i;  # the first pays for perl loading its socket code
}
print 'ok ', ($coarse ? '-' : join(',', @times)), "\n";
"""

# How long the client waits for a connect or an answer before it calls the worker unreachable.
WAIT_S = 5


def reach_argv(host: str, port: int, *, pings: int = 5, wait_s: int = WAIT_S) -> list[str]:
    return ["perl", "-e", _CLIENT, host, str(int(port)), str(int(pings)), str(int(wait_s))]


def handshakes_argv(host: str, port: int, *, samples: int = 7, wait_s: int = WAIT_S) -> list[str]:
    return ["perl", "-e", _HANDSHAKES, host, str(int(port)), str(int(samples)), str(int(wait_s))]


def _last_result(text: str) -> list[str] | Reach:
    """The words of the client's last "ok …" line, or the failure it (or its absence) means."""
    lines = [line for line in text.splitlines() if line.startswith(("ok ", "fail "))]
    if not lines:
        return Reach(False, "run", (text.strip().splitlines() or ["no output"])[-1][:300])
    words = lines[-1].split()
    if words[0] == "fail":
        return Reach(False, words[1] if len(words) > 1 else "run", " ".join(words[2:])[:300])
    return words


def parse_handshakes(text: str) -> Reach:
    """The handshakes' times as a Reach whose `rtt_ms` is their median."""
    words = _last_result(text)
    if isinstance(words, Reach):
        return words
    try:
        times = () if words[1] == "-" else tuple(float(x) for x in words[1].split(","))
    except (IndexError, ValueError):
        return Reach(False, "run", " ".join(words)[:300])
    return Reach(True, connect_ms=min(times) if times else None, pings_ms=times)


@dataclass(frozen=True)
class Reach:
    ok: bool
    stage: str = ""  # where it failed: "connect", "hello", "ping", "answer"
    reason: str = ""  # the OS's own words ("Connection refused", "Connection timed out", ...)
    connect_ms: float | None = None
    hello_ms: float | None = None
    protocol: str = ""
    pings_ms: tuple[float, ...] = ()

    @property
    def rtt_ms(self) -> float | None:
        """The round trip llama-server will pay per request: the median ping, else the connect's."""
        return round(statistics.median(self.pings_ms), 3) if self.pings_ms else self.connect_ms


def _ms(word: str) -> float | None:
    """A time the client printed; "-" where its perl has no Time::HiRes (Debian's bare perl-base)."""
    return None if word == "-" else float(word)


def parse_reach(text: str) -> Reach:
    words = _last_result(text)
    if isinstance(words, Reach):
        return words
    try:
        pings = tuple(float(x) for x in words[4].split(",")) if len(words) > 4 and words[4] != "-" else ()
        return Reach(
            True, connect_ms=_ms(words[1]), hello_ms=_ms(words[2]), protocol=words[3], pings_ms=pings
        )
    except (IndexError, ValueError):
        return Reach(False, "run", " ".join(words)[:300])


def likely_cause(reach: Reach, *, tunnel: bool) -> str:
    """Why the coordinator did not get through, in a sentence a person can act on."""
    reason = reach.reason.lower()
    if tunnel:
        if reach.stage == "connect":
            return "the SSH tunnel on the coordinator is not listening (its ssh process ended)"
        return (
            "the SSH tunnel does not reach the rpc-server: the worker's sshd refuses the forward "
            "(AllowTcpForwarding) or the rpc-server no longer listens on the worker's loopback"
        )
    if reach.stage == "connect" and ("timed out" in reason or "timeout" in reason):
        return "a firewall on the worker (or between the two machines) drops the coordinator's packets"
    if reach.stage == "connect" and "refused" in reason:
        return "a firewall on the worker rejects the coordinator, or nothing listens on that port"
    if reach.stage == "connect" and ("no route" in reason or "unreachable" in reason):
        return "the coordinator has no route to the worker (another network, a VPN down, a wrong address)"
    if reach.stage in ("hello", "answer", "ping"):
        return "something answers on that port but not as a ggml-rpc-server of RPC protocol " + str(
            PROTOCOL_MAJOR
        )
    return "the connection failed"


# Which Linux firewall front end a worker has, first found first: ufw (Ubuntu, Debian), firewalld (Fedora,
# RHEL, openSUSE), else plain iptables. Prints its name, or nothing.
FIREWALL_TOOL_ARGV = [
    "sh",
    "-c",
    'for t in ufw firewall-cmd iptables; do command -v "$t" >/dev/null 2>&1 && { echo "$t"; exit 0; }; done',
]
LINUX_FIREWALLS = ("ufw", "firewall-cmd", "iptables")


def firewall_fix(
    platform: str, coordinator: str, port: int, rpc_server_path: str = "", tool: str = ""
) -> str:
    """The command, on the worker, that lets the coordinator (an IPv4 address) in on `port`: for Linux, in
    the words of `tool` (one of LINUX_FIREWALLS, the one the worker has; ufw's when unknown)."""
    port = int(port)
    source = str(ipaddress.IPv4Address(coordinator)) if coordinator else ""
    if platform == "windows":
        remote = f" remoteip={source}" if source else ""
        return (
            f'netsh advfirewall firewall add rule name="ggml-rpc-server {port}" dir=in action=allow '
            f"protocol=TCP localport={port}{remote}"
        )
    if platform == "macos":
        app = shlex.quote(rpc_server_path or "/path/to/ggml-rpc-server")
        fw = "/usr/libexec/ApplicationFirewall/socketfilterfw"
        return f"sudo {fw} --add {app} && sudo {fw} --unblockapp {app}"
    if tool == "firewall-cmd":
        rich = f'source address="{source}/32" ' if source else ""
        return (
            f'sudo firewall-cmd --permanent --add-rich-rule=\'rule family="ipv4" {rich}port port="{port}" '
            f'protocol="tcp" accept\' && sudo firewall-cmd --reload'
        )
    if tool == "iptables":
        return f"sudo iptables -I INPUT -p tcp {f'-s {source} ' if source else ''}--dport {port} -j ACCEPT"
    return f"sudo ufw allow {f'from {source} ' if source else ''}to any port {port} proto tcp"
