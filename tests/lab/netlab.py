"""A test lab of "machines" on this host: network namespaces joined by veth pairs, each running its own sshd.

Every namespace gets a /24 of 10.77.0.0/16: the test process's side of the veth is 10.77.<i>.1, the
namespace's side 10.77.<i>.2, where <i> is allocated under a machine-wide file lock so parallel runs never
share a subnet. Names carry the pid of the creating process (`rdlab-<pid>-<n>`, veth `rdl<pid>h<n>`), which
lets `cleanup_leftovers` remove what a crashed earlier run left behind without touching a live run's hosts.

Only the network is separate: the namespaces share this host's file system, users and process table, so
`ip netns pids` is how teardown finds (and ends, by PID) every process that was started inside a host.

Traffic between two lab hosts is routed through this host, so it crosses iptables' FORWARD chain, whose
policy a running dockerd (or any host firewall) sets to DROP. Each lab inserts ACCEPT rules for the lab
subnet, tagged with its PID, while it runs, and deletes exactly those rules when it closes.

A host can be made slower and smaller, as a real weak machine is: `throttle_cpu` (cgroup `cpu` controller:
a share of one core), `limit_memory` (cgroup `memory` controller: the probe reports the limit as the host's
usable RAM) and `limit_link` (a `tc tbf` rate limit on both ends of its veth; `netem` is not available
here). The cgroups hold the host's sshd, so every process started over it inherits them. This machine has
cgroup v1 (one hierarchy per controller under /sys/fs/cgroup); the memory group nests under the memory
group this process already runs in, so whatever limits the machine itself sets keep applying.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "rdlab"
VETH_PREFIX = "rdl"
SUBNET = "10.77"
LOCK_PATH = "/run/ramdeck-lab.lock"
CGROUP_CPU_ROOT = Path("/sys/fs/cgroup/cpu")
CGROUP_MEMORY_MOUNT = Path("/sys/fs/cgroup/memory")
CGROUP_CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
NETNS_ETC = Path("/etc/netns")
SSHD = "/usr/sbin/sshd"
# A system user for the tests that need password authentication (namespaces share /etc/passwd).
PASSWORD_USER = "ramdeck-lab"
PASSWORD_USER_PASSWORD = "lab-only password 7f3e"
# That user's uid inside a host given a login that is not root (Lab.add_plain_login): no user of this machine.
PLAIN_UID = 47110

_serial = itertools.count()


def _forward_rules(pid: int) -> list[list[str]]:
    """The lab's FORWARD rules: accept packets from and to the lab subnet, tagged with the lab's PID."""
    tag = ["-m", "comment", "--comment", f"{PREFIX}-{pid}", "-j", "ACCEPT"]
    return [["-s", f"{SUBNET}.0.0/16", *tag], ["-d", f"{SUBNET}.0.0/16", *tag]]


def _iptables(action: str, rule: Sequence[str], *, check: bool = True) -> None:
    # -w waits for the xtables lock: dockerd and other labs change the tables too.
    _run(["iptables", "-w", action, "FORWARD", *rule], check=check)


class LabUnavailable(Exception):
    """This machine cannot run the lab (not root, no `ip netns`, ...). The message says why."""


def unavailable_reason() -> str | None:
    """Why the lab cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the network-namespace lab needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    if not Path(SSHD).exists():
        return "sshd is missing and could not be installed"
    return None


def ensure_sshd_installed() -> None:
    """Install Debian's openssh-server when /usr/sbin/sshd is missing (the lab's one real dependency)."""
    if Path(SSHD).exists() or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "openssh-server"],
        env=env,
        capture_output=True,
        timeout=900,
    )


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _keygen(path: Path, comment: str) -> None:
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """Serialise subnet allocation and user creation across concurrent test runs on this machine."""
    with open(LOCK_PATH, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _used_subnet_indexes() -> set[int]:
    out = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    return {int(m) for m in re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.1/", out)}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is gone for our purposes (PID 1 here may not reap).
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def kill_pid(pid: int, *, grace: float = 3.0) -> None:
    """TERM, wait up to `grace`, then KILL one process."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Reap it when it is our own child, so no zombie outlives the test.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _stop_child(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """End a process this test started (TERM, then KILL) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def namespace_pids(netns: str) -> list[int]:
    result = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


@dataclass
class LabHost:
    """One lab machine: a namespace with an address, maybe an sshd, and its files in `workdir`."""

    netns: str
    index: int
    veth_host: str
    veth_ns: str
    workdir: Path
    address: str
    host_address: str
    port: int = 22
    sshd_proc: subprocess.Popen | None = None
    host_key_path: Path | None = None
    password_auth: bool = False
    cgroup: Path | None = None  # The cpu controller's group (throttle_cpu).
    memory_cgroup: Path | None = None  # The memory controller's group (limit_memory).
    cpuset_cgroup: Path | None = None  # The cpuset controller's group (pin_cpus).
    link_mbit: float | None = None  # The tbf rate limit on its veth (limit_link).
    extra_pids: list[int] = field(default_factory=list)

    @property
    def cgroups(self) -> list[Path]:
        groups = (self.cgroup, self.memory_cgroup, self.cpuset_cgroup)
        return [group for group in groups if group is not None]

    @property
    def sshd_pid(self) -> int | None:
        return self.sshd_proc.pid if self.sshd_proc else None

    @property
    def host_public_key(self) -> str:
        """The sshd's host key as an OpenSSH public key line ("ssh-ed25519 AAAA...")."""
        assert self.host_key_path is not None
        return " ".join(Path(f"{self.host_key_path}.pub").read_text().split()[:2])

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """argv wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def limited_argv(self, argv: Sequence[str]) -> list[str]:
        """argv inside this host's namespace AND its cgroups, as if started over its sshd: the shell joins
        each group before it execs argv, so not one instruction runs outside the limits."""
        join = 'for g in "$@"; do [ "$g" = -- ] && break; echo $$ > "$g/cgroup.procs"; shift; done; shift; '
        script = join + 'exec "$@"'
        groups = [str(group) for group in self.cgroups]
        return self.exec_argv(with_cgroup_mounts(["sh", "-c", script, "limited", *groups, "--", *argv]))


class Lab:
    """A set of lab hosts created by one test; `close()` removes all of them (idempotent)."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        self.pid = os.getpid()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.pid}-"))
        self.hosts: list[LabHost] = []
        self._client_key = self.workdir / "client_ed25519"
        _keygen(self._client_key, "ramdeck-lab")
        self._closed = False
        self._forwarding: list[list[str]] = []
        if shutil.which("iptables"):
            for rule in _forward_rules(self.pid):
                _iptables("-I", rule)
                self._forwarding.append(rule)

    # -- the credentials tests log in with ------------------------------------------------------------

    @property
    def client_private_key(self) -> str:
        """The authorised test key (OpenSSH private key text)."""
        return self._client_key.read_text()

    @property
    def client_public_key(self) -> str:
        return Path(f"{self._client_key}.pub").read_text().strip()

    def other_private_key(self) -> str:
        """A valid key that no lab host authorises."""
        path = self.workdir / "stranger_ed25519"
        if not path.exists():
            _keygen(path, "stranger")
        return path.read_text()

    # -- hosts -------------------------------------------------------------------------------------------

    def add_host(self, *, sshd: bool = True, password_auth: bool = False) -> LabHost:
        serial = next(_serial)
        netns = f"{PREFIX}-{self.pid}-{serial}"
        veth_host, veth_ns = f"{VETH_PREFIX}{self.pid}h{serial}", f"{VETH_PREFIX}{self.pid}n{serial}"
        workdir = self.workdir / netns
        workdir.mkdir()
        with _machine_lock():
            index = next(i for i in range(1, 255) if i not in _used_subnet_indexes())
            host = LabHost(
                netns=netns,
                index=index,
                veth_host=veth_host,
                veth_ns=veth_ns,
                workdir=workdir,
                address=f"{SUBNET}.{index}.2",
                host_address=f"{SUBNET}.{index}.1",
            )
            # Registered before creation so a failure half-way is still torn down.
            self.hosts.append(host)
            self._create_network(host)
        if sshd:
            if password_auth:
                ensure_password_user()
            self.start_sshd(host, password_auth=password_auth)
        return host

    def _create_network(self, host: LabHost) -> None:
        _run(["ip", "netns", "add", host.netns])
        _run(["ip", "link", "add", host.veth_host, "type", "veth", "peer", "name", host.veth_ns])
        _run(["ip", "link", "set", host.veth_ns, "netns", host.netns])
        _run(["ip", "addr", "add", f"{host.host_address}/24", "dev", host.veth_host])
        _run(["ip", "link", "set", host.veth_host, "up"])
        inside = ["ip", "netns", "exec", host.netns]
        _run([*inside, "ip", "addr", "add", f"{host.address}/24", "dev", host.veth_ns])
        _run([*inside, "ip", "link", "set", host.veth_ns, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])

    def start_sshd(
        self,
        host: LabHost,
        *,
        password_auth: bool = False,
        new_host_key: bool = False,
        extra_config: Sequence[str] = (),
    ) -> None:
        """(Re)start the host's sshd; `new_host_key` regenerates its host key (a "changed host key");
        `extra_config` adds sshd_config lines (a hardened machine's settings, e.g.
        "AllowStreamLocalForwarding no")."""
        self.stop_sshd(host)
        key = host.workdir / "ssh_host_ed25519_key"
        if new_host_key or not key.exists():
            for path in (key, Path(f"{key}.pub")):
                path.unlink(missing_ok=True)
            _keygen(key, host.netns)
        host.host_key_path = key
        host.password_auth = password_auth
        authorized = host.workdir / "authorized_keys"
        authorized.write_text(self.client_public_key + "\n")
        config = host.workdir / "sshd_config"
        config.write_text(_sshd_config(host, key, authorized, password_auth, extra_config))
        _write_netns_passwd(host.netns)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory.
        log = host.workdir / "sshd.log"
        host.sshd_proc = subprocess.Popen(
            host.exec_argv(with_cgroup_mounts([SSHD, "-D", "-f", str(config), "-E", str(log)])),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for group in host.cgroups:
            (group / "cgroup.procs").write_text(str(host.sshd_proc.pid))
        self._wait_for_sshd(host, log)

    def _wait_for_sshd(self, host: LabHost, log: Path) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if host.sshd_proc is not None and host.sshd_proc.poll() is not None:
                raise RuntimeError(f"sshd in {host.netns} exited: {log.read_text() if log.exists() else ''}")
            with contextlib.suppress(OSError), socket.create_connection((host.address, host.port), 0.5) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"sshd in {host.netns} did not answer on {host.address}:{host.port}")

    def stop_sshd(self, host: LabHost) -> None:
        if host.sshd_proc is not None:
            _stop_child(host.sshd_proc)
            host.sshd_proc = None

    # -- faults and slowness -------------------------------------------------------------------------

    def link_down(self, host: LabHost) -> None:
        """The machine "goes away": its cable is pulled and packets to it vanish without an answer.

        The namespace's end goes down, not ours: our route then stays on the veth (flagged linkdown) and
        packets are dropped there. Taking our end down would remove the route and send them to the default
        gateway, off this machine.
        """
        _run(host.exec_argv(["ip", "link", "set", host.veth_ns, "down"]))

    def link_up(self, host: LabHost) -> None:
        """Bring the host's link back and wait until its sshd answers over it again (a link just set up
        may refuse connections for a moment; a test that goes on at once would see that, not its subject)."""
        _run(host.exec_argv(["ip", "link", "set", host.veth_ns, "up"]))
        if host.sshd_proc is not None:
            self._wait_for_sshd(host, host.workdir / "sshd.log")

    def throttle_cpu(self, host: LabHost, fraction: float, *, period_us: int = 100_000) -> Path:
        """Limit everything the host's sshd starts (from now on) to `fraction` of one core (cgroup v1).

        The quota is granted per period: within one, the host runs at full speed until it has used its
        share, then waits for the next. A short period (10 ms; the kernel's smallest quota is 1 ms) makes
        that a steady slowdown, like a slower CPU; the default 100 ms gives bursts of full speed, which is
        how a quota'd container behaves but not a slow machine."""
        if not CGROUP_CPU_ROOT.is_dir():
            raise LabUnavailable("cgroup v1 cpu controller is not mounted at /sys/fs/cgroup/cpu")
        group = CGROUP_CPU_ROOT / host.netns
        group.mkdir(exist_ok=True)
        period = max(period_us, math.ceil(1000 / fraction))
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, round(period * fraction))))
        host.cgroup = group
        for pid in [host.sshd_pid, *namespace_pids(host.netns)]:
            if pid:
                with contextlib.suppress(OSError):
                    (group / "cgroup.procs").write_text(str(pid))
        return group

    def cpu_shares(self, host: LabHost, shares: int) -> Path:
        """Let the host compete for this machine's cores as `shares` / 1024 ordinary processes would (cgroup
        v1 `cpu.shares`; its quota, if throttle_cpu set one, still caps it). A real machine competes with
        nobody; a lab host shares this one with whatever else runs on it, as one process per thread when it
        has no cpu group of its own, or as one process altogether when it has one."""
        if not CGROUP_CPU_ROOT.is_dir():
            raise LabUnavailable("cgroup v1 cpu controller is not mounted at /sys/fs/cgroup/cpu")
        group = CGROUP_CPU_ROOT / host.netns
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(int(shares)))
        host.cgroup = group
        for pid in [host.sshd_pid, *namespace_pids(host.netns)]:
            if pid:
                with contextlib.suppress(OSError):
                    (group / "cgroup.procs").write_text(str(pid))
        return group

    def pin_cpus(self, host: LabHost, cpus: Sequence[int]) -> Path:
        """Keep everything the host's sshd starts (from now on) on `cpus` (cgroup v1 `cpuset`): a machine
        with fewer cores, each at full speed, with no quota (the probe sees the cores as its own: `nproc`
        and the scheduler's affinity follow the cpuset)."""
        if not (CGROUP_CPUSET_ROOT / "cpuset.cpus").is_file():
            raise LabUnavailable(f"cgroup v1 cpuset controller is not mounted at {CGROUP_CPUSET_ROOT}")
        allowed = _cpu_list((CGROUP_CPUSET_ROOT / "cpuset.cpus").read_text())
        if not cpus or any(cpu not in allowed for cpu in cpus):
            raise ValueError(f"CPUs {list(cpus)} are not among this machine's {sorted(allowed)}.")
        group = CGROUP_CPUSET_ROOT / host.netns
        group.mkdir(exist_ok=True)
        # A new cpuset group starts with no CPUs and no memory nodes: both must be set before it takes tasks.
        (group / "cpuset.mems").write_text((CGROUP_CPUSET_ROOT / "cpuset.mems").read_text().strip())
        (group / "cpuset.cpus").write_text(",".join(str(cpu) for cpu in cpus))
        host.cpuset_cgroup = group
        for pid in [host.sshd_pid, *namespace_pids(host.netns)]:
            if pid:
                with contextlib.suppress(OSError):
                    (group / "cgroup.procs").write_text(str(pid))
        return group

    def unthrottle_cpu(self, host: LabHost) -> None:
        if host.cgroup is None:
            return
        _remove_cgroup(host.cgroup)
        host.cgroup = None

    def limit_memory(self, host: LabHost, limit_bytes: int) -> Path:
        """Limit the memory of everything the host's sshd starts (from now on) to `limit_bytes` (cgroup v1
        `memory.limit_in_bytes`). A process that goes beyond it is OOM-killed, as on a small machine, and
        the probe reports the limit as the host's RAM."""
        parent = memory_cgroup_parent()
        if not (parent / "memory.limit_in_bytes").is_file():
            raise LabUnavailable(f"cgroup v1 memory controller is not mounted at {CGROUP_MEMORY_MOUNT}")
        group = parent / host.netns
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
        host.memory_cgroup = group
        for pid in [host.sshd_pid, *namespace_pids(host.netns)]:
            if pid:
                with contextlib.suppress(OSError):
                    (group / "cgroup.procs").write_text(str(pid))
        return group

    def unlimit_memory(self, host: LabHost) -> None:
        if host.memory_cgroup is None:
            return
        _remove_cgroup(host.memory_cgroup)
        host.memory_cgroup = None

    def limit_link(self, host: LabHost, mbit: float, *, burst_kib: int = 64, latency_ms: int = 50) -> None:
        """Rate-limit the host's link to `mbit` megabits per second both ways (a token bucket on each end
        of its veth; netem's delay is not available on this kernel). Gone with the veth, or unlimit_link."""
        shape = ["tbf", "rate", f"{mbit:g}mbit", "burst", f"{burst_kib}kb", "latency", f"{latency_ms}ms"]
        _run(["tc", "qdisc", "replace", "dev", host.veth_host, "root", *shape])
        _run(host.exec_argv(["tc", "qdisc", "replace", "dev", host.veth_ns, "root", *shape]))
        host.link_mbit = mbit

    def unlimit_link(self, host: LabHost) -> None:
        if host.link_mbit is None:
            return
        _run(["tc", "qdisc", "del", "dev", host.veth_host, "root"], check=False)
        _run(host.exec_argv(["tc", "qdisc", "del", "dev", host.veth_ns, "root"]), check=False)
        host.link_mbit = None

    def delay_path(self, source: LabHost, target: LabHost, ms: float) -> None:
        """Delay every packet from `source` to `target`'s address by `ms` milliseconds (one way: the round
        trip between the two grows by `ms`; every other path, the console's to either host included, stays
        as it was). tests/lab/delay_relay.py carries the packets; it ends with the hosts."""
        tag = f"{VETH_PREFIX}{self.pid % 10**7}"
        out_tun, in_tun = f"{tag}o{source.index}", f"{tag}i{target.index}"
        relay = subprocess.Popen(
            source.exec_argv(
                [
                    sys.executable,
                    str(Path(__file__).with_name("delay_relay.py")),
                    out_tun,
                    target.netns,
                    in_tun,
                    str(ms),
                ]
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        source.extra_pids.append(relay.pid)
        line = relay.stdout.readline() if relay.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(
                f"the delay relay did not start: {line}{relay.stdout.read() if relay.stdout else ''}"
            )
        inside, into = source.exec_argv, target.exec_argv
        # The answers come back over the veth, not the TUN device the packets left by: no reverse-path filter.
        for run_in, device in ((inside, source.veth_ns), (into, in_tun)):
            for name in ("all", device):
                _run(run_in(["sysctl", "-q", "-w", f"net.ipv4.conf.{name}.rp_filter=0"]))
        _run(inside(["ip", "link", "set", out_tun, "up"]))
        _run(into(["ip", "link", "set", in_tun, "up"]))
        _run(
            inside(["ip", "route", "replace", f"{target.address}/32", "dev", out_tun, "src", source.address])
        )

    # -- a login that is not root -------------------------------------------------------------------------

    def add_plain_login(self, host: LabHost, *, sudoers: str = "") -> Path:
        """Give `host` a login that is not root: PASSWORD_USER (the one the lab's sshd allows besides root)
        as uid PLAIN_UID, with a home of its own and the lab's key; `sudoers` becomes the host's
        /etc/sudoers. `ip netns exec` bind-mounts the files of /etc/netns/<host>/ over /etc, so the user,
        its group, its shadow entry (sudo's PAM account check needs one) and the sudo rules exist inside
        this host only. The host's sshd is started again (it sees only the files there when it starts).
        Returns the home folder."""
        # The user reads its home and the lab's authorized_keys file under the lab's folders.
        self.workdir.chmod(0o711)
        host.workdir.chmod(0o755)
        home = host.workdir / "home"
        home.mkdir(exist_ok=True)
        os.chown(home, PLAIN_UID, PLAIN_UID)
        directory = NETNS_ETC / host.netns
        directory.mkdir(parents=True, exist_ok=True)
        for name, line, mode in (
            ("group", f"{PASSWORD_USER}:x:{PLAIN_UID}:", 0o644),
            ("shadow", f"{PASSWORD_USER}:*:19000:0:99999:7:::", 0o640),
        ):
            kept = [
                x
                for x in Path("/etc", name).read_text().splitlines()
                if not x.startswith(f"{PASSWORD_USER}:")
            ]
            (directory / name).write_text("\n".join([*kept, line]) + "\n")
            (directory / name).chmod(mode)
        self.set_sudoers(host, sudoers)
        self.start_sshd(host, password_auth=host.password_auth)
        (host.workdir / "authorized_keys").chmod(0o644)
        # After the start, which writes the host's passwd: rewritten in place (the same file), so the
        # bind mount the sshd holds shows the user.
        passwd = directory / "passwd"
        kept = [x for x in passwd.read_text().splitlines() if not x.startswith(f"{PASSWORD_USER}:")]
        passwd.write_text(
            "\n".join([*kept, f"{PASSWORD_USER}:x:{PLAIN_UID}:{PLAIN_UID}::{home}:/bin/sh"]) + "\n"
        )
        return home

    def set_sudoers(self, host: LabHost, rules: str) -> None:
        """The host's own /etc/sudoers (see add_plain_login): sudo's defaults as Debian ships them, root's
        rule, and `rules`. Written in place, so a running host sees the change at once."""
        path = NETNS_ETC / host.netns / "sudoers"
        path.parent.mkdir(parents=True, exist_ok=True)
        header = [
            "Defaults env_reset",
            'Defaults secure_path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"',
            "root ALL=(ALL:ALL) ALL",
        ]
        path.write_text("\n".join([*header, rules]) + "\n")
        path.chmod(0o440)

    # -- teardown ----------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for host in reversed(self.hosts):
            try:
                self._destroy(host)
            except Exception as exc:  # Keep going: every host must be torn down.
                errors.append(f"{host.netns}: {exc}")
        shutil.rmtree(self.workdir, ignore_errors=True)
        for rule in self._forwarding:
            # By exact rule (one copy each: another lab of this process may hold the same ones).
            _iptables("-D", rule, check=False)
        self._forwarding = []
        if errors:
            raise RuntimeError("lab teardown left things behind: " + "; ".join(errors))

    def _destroy(self, host: LabHost) -> None:
        self.stop_sshd(host)
        for pid in [*host.extra_pids, *namespace_pids(host.netns)]:
            kill_pid(pid, grace=1.0)
        for group in host.cgroups:
            _remove_cgroup(group)
        _run(["ip", "link", "del", host.veth_host], check=False)
        _run(["ip", "netns", "del", host.netns], check=False)
        shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def with_cgroup_mounts(argv: Sequence[str]) -> list[str]:
    """argv, preceded by mounting this machine's cgroup file systems where they are mounted here.

    `ip netns exec` gives the command a fresh /sys (for the namespace's own network devices), in which
    /sys/fs/cgroup is empty: a lab host would not see its own limits, where every real machine does (the
    probe reads them). Mounting a hierarchy again attaches to the existing one, so the groups and their
    limits are the same ones; the mounts belong to the command's private mount namespace and end with it.
    A mount that fails is skipped: the command still runs, only without that view.
    """
    lines = []
    with contextlib.suppress(OSError):
        for entry in Path("/proc/self/mounts").read_text().splitlines():
            fields = entry.split()
            if len(fields) < 4 or not (
                fields[1] == "/sys/fs/cgroup" or fields[1].startswith("/sys/fs/cgroup/")
            ):
                continue
            target, fstype = shlex.quote(fields[1]), fields[2]
            options = shlex.quote(",".join(o for o in fields[3].split(",") if o not in ("rw", "relatime")))
            if fstype == "tmpfs":
                lines.append(f"mount -t tmpfs -o mode=755 cgroup_root {target}")
            elif fstype == "cgroup":
                lines.append(f"mkdir -p {target} && mount -t cgroup -o {options} cgroup {target}")
            elif fstype == "cgroup2":
                lines.append(f"mkdir -p {target} && mount -t cgroup2 cgroup2 {target}")
    script = "".join(f"{line} 2>/dev/null; " for line in lines) + 'exec "$@"'
    return ["sh", "-c", script, "with-cgroups", *argv]


def _write_netns_passwd(netns: str) -> None:
    """Give the lab host's root the login shell of a minimal server, /bin/sh.

    `ip netns exec` bind-mounts /etc/netns/<name>/* over /etc inside the namespace, so this passwd is what
    the host's sshd sees. Without it every command would start this machine's root bash, whose .bashrc
    (pyenv init here) costs ~0.2 s of CPU per command and would dominate every timing taken in the lab.
    Home directories stay the same, so ~/.ramdeck build caches are shared with the host.
    """
    lines = []
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[0] == "root":
            fields[6] = "/bin/sh"
        lines.append(":".join(fields))
    directory = NETNS_ETC / netns
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "passwd").write_text("\n".join(lines) + "\n")


def _sshd_config(
    host: LabHost, key: Path, authorized: Path, password_auth: bool, extra: Sequence[str] = ()
) -> str:
    return "\n".join(
        [
            f"ListenAddress {host.address}:{host.port}",
            f"HostKey {key}",
            f"AuthorizedKeysFile {authorized}",
            f"PidFile {host.workdir / 'sshd.pid'}",
            f"PasswordAuthentication {'yes' if password_auth else 'no'}",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password",
            f"AllowUsers root {PASSWORD_USER}",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "MaxStartups 200",
            "MaxSessions 200",
            "LogLevel VERBOSE",
            "Subsystem sftp internal-sftp",
            *extra,
            "",
        ]
    )


def ensure_password_user() -> None:
    """Create the lab's password-login user (no home, no privileges) and set its known password."""
    with _machine_lock():
        if _run(["id", PASSWORD_USER], check=False).returncode != 0:
            _run(["useradd", "--system", "--no-create-home", "-d", "/", "-s", "/bin/sh", PASSWORD_USER])
        subprocess.run(
            ["chpasswd"], input=f"{PASSWORD_USER}:{PASSWORD_USER_PASSWORD}\n", text=True, check=True
        )


def memory_cgroup_parent() -> Path:
    """The memory cgroup (v1) this process runs in, under which lab hosts' memory groups are made: nesting
    keeps every limit the machine already places on this process in force for the lab hosts too."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return CGROUP_MEMORY_MOUNT / path.strip("/")
    return CGROUP_MEMORY_MOUNT


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a cpuset list ("0-3,6")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _remove_cgroup(group: Path) -> None:
    """Move the group's processes back to its parent group, then remove it."""
    procs = group / "cgroup.procs"
    with contextlib.suppress(OSError):
        for pid in procs.read_text().split():
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        group.rmdir()


def cleanup_leftovers() -> list[str]:
    """Remove namespaces, veths, cgroups and temp dirs of earlier runs whose process is gone."""
    removed: list[str] = []
    if unavailable_reason():
        return removed
    netns_out = _run(["ip", "netns", "list"], check=False).stdout
    for name in re.findall(rf"^({PREFIX}-(\d+)-\d+)", netns_out, flags=re.M):
        netns, pid = name[0], int(name[1])
        if _pid_alive(pid):
            continue
        for child in namespace_pids(netns):
            kill_pid(child, grace=1.0)
        _run(["ip", "netns", "del", netns], check=False)
        removed.append(netns)
    for stale in NETNS_ETC.glob(f"{PREFIX}-*-*") if NETNS_ETC.is_dir() else []:
        with contextlib.suppress(ValueError):
            if not _pid_alive(int(stale.name.split("-")[1])):
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(str(stale))
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for veth, pid in re.findall(rf"^\d+: ({VETH_PREFIX}(\d+)[hn]\d+)[@:]", links, flags=re.M):
        if not _pid_alive(int(pid)):
            _run(["ip", "link", "del", veth], check=False)
            removed.append(veth)
    for root in (CGROUP_CPU_ROOT, CGROUP_CPUSET_ROOT, memory_cgroup_parent()):
        for group in root.glob(f"{PREFIX}-*-*") if root.is_dir() else []:
            if not _pid_alive(int(group.name.split("-")[1])):
                _remove_cgroup(group)
                removed.append(str(group))
    if shutil.which("iptables"):
        rules = _run(["iptables", "-w", "-S", "FORWARD"], check=False).stdout
        for pid in {int(p) for p in re.findall(rf"--comment {PREFIX}-(\d+)\b", rules)}:
            if not _pid_alive(pid):
                for rule in _forward_rules(pid):
                    while _run(["iptables", "-w", "-D", "FORWARD", *rule], check=False).returncode == 0:
                        pass
                removed.append(f"iptables FORWARD rules of {PREFIX}-{pid}")
    for stale in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-*"):
        with contextlib.suppress(ValueError):
            if not _pid_alive(int(stale.name.split("-")[1])):
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(str(stale))
    return removed
