"""The probe script: one POSIX shell script that prints everything the probe needs in one round trip.

It prints sections headed `@@@ <name>` that nodes/probe/parse.py parses, and branches on `uname -s` itself so
Linux and macOS need no second trip. Its inputs arrive as positional arguments (never as formatted text):
"$1" the RPC port to check, "$2" (optional) the llama-server whose version the console already knows.
It starts as few processes as it can: on a small board or a busy node every fork counts.
"""

from __future__ import annotations

PROBE_SCRIPT = r"""
port="$1"
# The llama-server whose version the console already recorded (its build): not run again just to ask.
known_server="${2:-}"
sec() { printf '\n%s%s\n' '@@@ ' "$1"; }
set -- $(uname -snrm)
sec uname; echo "$1 $3 $4"
sec hostname; echo "$2"
case "$1" in
Darwin)
  sec sw_vers; sw_vers 2>/dev/null
  sec sysctl
  # The Metal wired limit is iogpu.wired_limit_mb on macOS 14 and later, debug.iogpu.wired_limit on 13;
  # sysctl prints the names it knows and complains (to stderr) about the other.
  sysctl hw.memsize hw.ncpu hw.physicalcpu hw.pagesize machdep.cpu.brand_string \
    iogpu.wired_limit_mb debug.iogpu.wired_limit 2>/dev/null
  sec vm_stat; vm_stat 2>/dev/null
  sec displays; system_profiler SPDisplaysDataType 2>/dev/null
  sec listeners; lsof -nP -iTCP:"$port" -sTCP:LISTEN 2>/dev/null
  ;;
*)
  # Every file in one `head -v` (one process, "==> path <==" headers); the cgroup paths come from
  # /proc/self/cgroup, read with shell builtins only.
  cg1="" cg2="" cgc=""
  while IFS=: read -r id controllers path; do
    [ "$id" = 0 ] && [ -z "$controllers" ] && cg2=$path
    case ",$controllers," in *,memory,*) cg1=$path ;; esac
    case ",$controllers," in *,cpu,*) cgc=$path ;; esac
  done < /proc/self/cgroup
  sec files
  head -v -n 100000 /etc/os-release /proc/cpuinfo /proc/meminfo /proc/self/status \
    /proc/sys/kernel/osrelease /proc/version \
    "/sys/fs/cgroup$cg2/memory.max" /sys/fs/cgroup/memory.max \
    "/sys/fs/cgroup$cg2/memory.current" /sys/fs/cgroup/memory.current \
    "/sys/fs/cgroup/memory$cg1/memory.limit_in_bytes" /sys/fs/cgroup/memory/memory.limit_in_bytes \
    "/sys/fs/cgroup/memory$cg1/memory.usage_in_bytes" /sys/fs/cgroup/memory/memory.usage_in_bytes \
    "/sys/fs/cgroup$cg2/memory.stat" "/sys/fs/cgroup/memory$cg1/memory.stat" \
    "/sys/fs/cgroup$cg2/cpu.max" "/sys/fs/cgroup/cpu$cgc/cpu.cfs_quota_us" \
    "/sys/fs/cgroup/cpu$cgc/cpu.cfs_period_us" \
    2>/dev/null
  # WSL2, a Linux VM inside Windows: its kernel calls itself "microsoft-standard-WSL2" (uname -r, read again
  # from /proc above), and WSL itself leaves /run/WSL and, in its own sessions, WSL_INTEROP. The kernel alone
  # is not enough: Docker Desktop's containers run on the same kernel, behind Docker's networking. Only on
  # WSL: its networking mode (wslinfo, WSL 2.0 and later) and the VM's own addresses, which a port forward
  # on the Windows side points at. `addresses=` comes last: `ip` may print several lines.
  sec wsl
  case "$3" in *[Mm]icrosoft*|*WSL*)
    [ -e /run/WSL ] && echo "run_wsl=yes"
    [ -n "${WSL_INTEROP:-}" ] && echo "interop=yes"
    if [ -e /run/WSL ] || [ -n "${WSL_INTEROP:-}" ]; then
      command -v wslinfo >/dev/null 2>&1 && echo "networking_mode=$(wslinfo --networking-mode 2>/dev/null)"
      echo "addresses=$(hostname -I 2>/dev/null || ip -4 -o addr show scope global 2>/dev/null)"
    fi
    ;;
  esac
  sec nvidia-smi
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits 2>&1
  fi
  sec rocm-smi
  if command -v rocm-smi >/dev/null 2>&1; then
    rocm-smi --showproductname --showmeminfo vram --json 2>/dev/null
    # The GPUs' targets (gfx1100, ...) as the kernel's KFD topology states them, for rocm-smi releases whose
    # product name lacks "GFX Version". Shell builtins only.
    sec kfd
    for f in /sys/class/kfd/kfd/topology/nodes/*/properties; do
      [ -r "$f" ] || continue
      while read -r key value; do [ "$key" = gfx_target_version ] && echo "$value"; done < "$f"
    done
  fi
  # Vulkan's devices (llama.cpp's Vulkan backend names them Vulkan0..), and the GPUs on the PCI bus with an
  # amdgpu card's VRAM from sysfs, read with shell builtins; lspci names them when vulkaninfo is missing.
  sec vulkaninfo
  if command -v vulkaninfo >/dev/null 2>&1; then
    vulkaninfo --summary 2>/dev/null
  fi
  # The devices llama.cpp's Vulkan backend takes when the node's environment names them (its
  # GGML_VK_VISIBLE_DEVICES, like CUDA_VISIBLE_DEVICES): printed only when set, even to nothing.
  sec vk-visible
  [ -n "${GGML_VK_VISIBLE_DEVICES+set}" ] && printf 'set=%s\n' "$GGML_VK_VISIBLE_DEVICES"
  sec drm
  for c in /sys/class/drm/card*; do
    case "${c##*/}" in *-*) continue ;; esac
    d=$c/device
    [ -r "$d/vendor" ] && [ -r "$d/device" ] || continue
    read -r vendor < "$d/vendor"; read -r device < "$d/device"
    total=0 used=0
    [ -r "$d/mem_info_vram_total" ] && read -r total < "$d/mem_info_vram_total"
    [ -r "$d/mem_info_vram_used" ] && read -r used < "$d/mem_info_vram_used"
    echo "${c##*/} $vendor $device $total $used"
  done
  sec lspci
  if ! command -v vulkaninfo >/dev/null 2>&1 && command -v lspci >/dev/null 2>&1; then
    lspci -nn 2>/dev/null
  fi
  # Who listens on the port. `ss` asks the kernel over netlink for listening sockets on that port only,
  # which is far cheaper than reading /proc/net/tcp (the kernel walks its whole socket table to print it).
  # -p walks every process's file descriptors, so it runs only when something listens there. Without
  # -H (older ss lacks it) the output has a header line: a second line means a listener.
  sec listeners
  if command -v ss >/dev/null 2>&1; then
    found=$(ss -ltn "sport = :$port" 2>/dev/null)
    case "$found" in *"
"*) ss -ltnp "sport = :$port" 2>/dev/null ;; esac
  else
    hexport=$(printf '%04X' "$port")
    if grep -q ":$hexport [0-9A-F]*:[0-9A-F]* 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null; then
      echo "ss is not installed: port $port is in use, but its process cannot be named"
    fi
  fi
  ;;
esac
# llama.cpp: on the PATH first, else in the console's build cache under ~/.ramdeck/llama.cpp.
sec binaries
server=""
for name in ggml-rpc-server rpc-server llama-server; do
  command -v "$name" 2>/dev/null
done
command -v llama-server >/dev/null 2>&1 && server=llama-server
on_path() { command -v llama-server && { command -v ggml-rpc-server || command -v rpc-server; }; }
if ! on_path >/dev/null 2>&1; then
  # The build cache's layout is fixed (<root>/src-<hash>/llama.cpp/build-<backend>/bin/), so a glob finds
  # its binaries without walking the source trees.
  for path in "$HOME"/.ramdeck/llama.cpp/src-*/llama.cpp/build-*/bin/ggml-rpc-server \
      "$HOME"/.ramdeck/llama.cpp/src-*/llama.cpp/build-*/bin/rpc-server \
      "$HOME"/.ramdeck/llama.cpp/src-*/llama.cpp/build-*/bin/llama-server; do
    [ -x "$path" ] || continue
    echo "$path"
    case "$path" in */llama-server) [ -z "$server" ] && server=$path ;; esac
  done
fi
sec llama-server-version
[ -n "$server" ] && [ "$server" != "$known_server" ] && "$server" --version 2>&1
sec end
"""
