"""The build tools of the fake Windows PC (tests/lab/windows_host.py), one script under several names:
cmake.exe, tar.exe and vswhere.exe, each answering the arguments the console gives it as the real program
documents, on the PC's Windows paths (C:\\x is <root>/C/x).

- vswhere.exe prints the installationPath of the Visual Studio the PC "has" (state "msvc"), or nothing, as
  vswhere does when no installation has the component asked for.
- tar.exe is Windows' bsdtar: -xzf ARCHIVE -C FOLDER --strip-components=N, run by the host's GNU tar on the
  mapped paths.
- cmake.exe cannot compile here. Configuring checks the source folder's CMakeLists.txt and the generator's
  compiler (Visual Studio's for the default generator, ninja and the named compiler for -G Ninja) and writes
  a CMakeCache.txt with the -D values, as CMake does; building puts each target's program where the
  generator would (bin\\Release\\ for Visual Studio, bin\\ for Ninja): the lab's Linux build of it, from the
  state's "build_outputs", stands for the .exe.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def _root() -> Path:
    here = Path(sys.argv[0]).absolute()
    for parent in here.parents:
        if (parent / "state.json").is_file():
            return parent
    raise SystemExit("windows_tools: no state.json above this program")


ROOT = _root()
STATE = json.loads((ROOT / "state.json").read_text())


def local(path: str) -> Path:
    match = re.fullmatch(r"([A-Za-z]):[\\/](.*)", path, re.S)
    if not match:
        raise SystemExit(f"not an absolute Windows path: {path!r}")
    return ROOT / match[1].upper() / Path(*[p for p in re.split(r"[\\/]", match[2]) if p])


def on_path(name: str) -> bool:
    return any((local(folder) / f"{name}.exe").exists() for folder in STATE["path"])


def vswhere(args: list[str]) -> int:
    if "-property" in args and STATE.get("msvc"):
        print(STATE["msvc"])
    return 0


def tar(args: list[str]) -> int:
    mapped = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-xzf", "-C") and i + 1 < len(args):
            mapped += [arg, str(local(args[i + 1]))]
            i += 2
            continue
        mapped.append(arg)
        i += 1
    return subprocess.run(["tar", *mapped]).returncode


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def cmake_configure(args: list[str]) -> int:
    source, build = _option(args, "-S"), _option(args, "-B")
    if not source or not build:
        print("CMake Error: both -S and -B are needed here", file=sys.stderr)
        return 1
    if not (local(source) / "CMakeLists.txt").is_file():
        print(
            f'CMake Error: The source directory "{source}" does not appear to contain CMakeLists.txt.',
            file=sys.stderr,
        )
        return 1
    generator = _option(args, "-G")
    if generator is None:
        if not STATE.get("msvc"):
            print("CMake Error: CMAKE_C_COMPILER not set, after EnableLanguage", file=sys.stderr)
            return 1
        generator = "Visual Studio 17 2022"
        print(f"-- Building for: {generator}")
    elif generator == "Ninja" and not on_path("ninja"):
        print(
            'CMake Error: CMake was unable to find a build program corresponding to "Ninja".', file=sys.stderr
        )
        return 1
    values = [a[2:].partition("=") for a in args if a.startswith("-D")]
    folder = local(build)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"CMAKE_GENERATOR:INTERNAL={generator}"] + [
        f"{name}:STRING={value}" for name, _, value in values
    ]
    (folder / "CMakeCache.txt").write_text("\r\n".join(lines) + "\r\n")
    print("-- Configuring done (3.1s)")
    print("-- Generating done (0.4s)")
    print(f"-- Build files have been written to: {build.replace(chr(92), '/')}")
    return 0


def cmake_build(args: list[str]) -> int:
    build = args[1]
    cache = local(build) / "CMakeCache.txt"
    if not cache.is_file():
        print(
            f"Error: {build} is not a directory containing a CMake build (no CMakeCache.txt)", file=sys.stderr
        )
        return 1
    generator = re.search(r"CMAKE_GENERATOR:INTERNAL=(.*)", cache.read_text())[1].strip()
    visual_studio = generator.startswith("Visual Studio")
    targets = args[args.index("--target") + 1 :] if "--target" in args else []
    bin_dir = local(build) / "bin" / ("Release" if visual_studio else "")
    bin_dir.mkdir(parents=True, exist_ok=True)
    for target in targets:
        program = STATE.get("build_outputs", {}).get(target)
        if not program:
            print(f"error MSB1009: Project file does not exist. Switch: {target}.vcxproj", file=sys.stderr)
            return 1
        exe = bin_dir / f"{target}.exe"
        exe.unlink(missing_ok=True)
        exe.symlink_to(program)
        where = build + "\\bin\\" + ("Release\\" if visual_studio else "") + f"{target}.exe"
        print(f"  {target}.vcxproj -> {where}" if visual_studio else f"[1/1] Linking CXX executable {where}")
    return 0


def cmake(args: list[str]) -> int:
    if args[:1] == ["--version"]:
        print("cmake version 3.29.2\n\nCMake suite maintained and supported by Kitware (kitware.com/cmake).")
        return 0
    if args[:1] == ["--build"]:
        return cmake_build(args)
    return cmake_configure(args)


def main() -> int:
    name = Path(sys.argv[0]).name.lower().removesuffix(".exe")
    tool = {"vswhere": vswhere, "tar": tar, "cmake": cmake}.get(name)
    if tool is None:
        raise SystemExit(f"windows_tools: no tool called {name}")
    return tool(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
