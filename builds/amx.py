"""Whether a node's CPU really runs AMX, the Intel matrix instructions llama.cpp's CPU backend uses.

A CPU can list AMX (`amx_tile` in /proc/cpuinfo, and the kernel enabling its state) and still fault on its
instructions: a virtual machine whose hypervisor does not pass the tile registers through (a Firecracker VM
did exactly this). A build with GGML_NATIVE takes `-march=native`, compiles llama.cpp's AMX kernels, and
llama-server then dies (SIGILL at `tilezero`, SIGSEGV at `ldtilecfg`) at its first matrix product on the
CPU, which nothing before the first answer shows. So before compiling the build job runs a small program
on the node that does what llama.cpp's AMX code does first (ask Linux for the tile data, load a tile
configuration, zero a tile); when it dies, the build leaves AMX out. GCC and Clang give an explicit
`-mno-<feature>` precedence over what `-march=native` turns on, whatever their order on the command line, so
the rest of the native build (AVX-512, VNNI, and llama.cpp's CPU_REPACK kernels) is kept.
"""

from __future__ import annotations

AMX_CHECK_C = r"""
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <immintrin.h>
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
int main(void) {
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as ggml_amx_init asks: refused means llama.cpp turns its
       AMX buffers off by itself. */
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    config.colsb[0] = 64;
    config.rows[0] = 16;
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""

# $1: the program above; $2: the CPU list to read (/proc/cpuinfo; the tests give their own). Prints one line,
# amx=absent|works|refused|faults|untested.
AMX_CHECK_SCRIPT = r"""
grep -qw amx_tile "${2:-/proc/cpuinfo}" 2>/dev/null || { echo amx=absent; exit 0; }
dir=$(mktemp -d) || { echo amx=untested; exit 0; }
printf '%s\n' "$1" > "$dir/amx.c"
if ! "${CC:-cc}" -O1 -mamx-tile "$dir/amx.c" -o "$dir/amx" >/dev/null 2>&1; then
  echo amx=untested
else
  # Run by a shell of its own that waits for it, so the shell's "Illegal instruction" goes nowhere.
  sh -c '"$1" >/dev/null 2>&1; status=$?; exit "$status"' sh "$dir/amx" 2>/dev/null
  status=$?
  if [ "$status" -eq 0 ]; then echo amx=works
  elif [ "$status" -eq 2 ]; then echo amx=refused
  else echo amx=faults
  fi
fi
rm -rf "$dir"
"""

# What the build adds on a node whose AMX faults.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_FLAGS = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def amx_check_argv(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    return ["sh", "-c", AMX_CHECK_SCRIPT, "sh", AMX_CHECK_C, cpuinfo]


def amx_verdict(output: str) -> str:
    """absent, works, refused, faults or untested, from the script's output ("untested" when unreadable)."""
    for line in output.splitlines():
        if line.startswith("amx="):
            verdict = line[4:].strip()
            if verdict in ("absent", "works", "refused", "faults", "untested"):
                return verdict
    return "untested"


def amx_flags(verdict: str) -> list[str]:
    """The CMake flags that leave AMX out of a build on a CPU whose AMX faults; none otherwise."""
    return list(NO_AMX_FLAGS) if verdict == "faults" else []
