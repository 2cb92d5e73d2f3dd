"""A lab host that answers like a Windows PC behind Windows' OpenSSH server: `windows_like(lab, host)`.

Its sshd runs every session through tests/lab/fake_powershell.py (ForceCommand: the command arrives in
SSH_ORIGINAL_COMMAND as Windows' sshd hands it to PowerShell), with a Windows file system under
<workdir>/windows (C:\\x is <root>/C/x). The PC's CIM classes answer with the recorded values of a real
Windows 11 desktop (tests/data/probe/windows11_ryzen_cim.json); nvidia-smi is absent unless `nvidia_smi`
gives its CSV, vulkaninfo unless `vulkaninfo` gives its --summary, and its video controllers are
`video` (Win32_VideoController's rows). Its PATH holds C:\\Windows\\System32 with one program,
echo-argv.exe, which prints the argument vector it was given as JSON (the hostile-input tests compare it
with what the console meant).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.paths import DATA

FAKE_SHELL = Path(__file__).resolve().parent / "fake_powershell.py"
RECORDED_CIM = DATA / "probe" / "windows11_ryzen_cim.json"
WINDOWS_TOOLS = Path(__file__).resolve().parent / "windows_tools.py"
SYSTEM32 = "C:\\Windows\\System32"
CMAKE_BIN = "C:\\Program Files\\CMake\\bin"
PROGRAM_FILES_X86 = "C:\\Program Files (x86)"
VSWHERE = "Microsoft Visual Studio\\Installer\\vswhere.exe"
BUILD_TOOLS_2022 = "C:\\Program Files (x86)\\Microsoft Visual Studio\\2022\\BuildTools"
USER_HOME = "C:\\Users\\ramdeck"


@dataclass
class WindowsRoot:
    root: Path

    def local(self, windows_path: str) -> Path:
        drive, rest = windows_path.split(":\\", 1)
        return self.root / drive / Path(*[p for p in rest.split("\\") if p])

    def install(self, windows_path: str, program: Path) -> None:
        """Put `program` at `windows_path` (a symlink: the lab's Linux build stands for the .exe)."""
        target = self.local(windows_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(program)

    def add_to_path(self, windows_folder: str) -> None:
        state = json.loads((self.root / "state.json").read_text())
        state["path"].append(windows_folder)
        (self.root / "state.json").write_text(json.dumps(state))

    def update_state(self, **values) -> None:
        state = json.loads((self.root / "state.json").read_text())
        state.update(values)
        (self.root / "state.json").write_text(json.dumps(state))

    def install_build_tools(
        self,
        *,
        cmake: bool = True,
        msvc: bool = True,
        tar: bool = True,
        outputs: dict[str, Path] | None = None,
    ) -> None:
        """The PC's build tools (tests/lab/windows_tools.py): CMake in its installer's folder on the PATH,
        Visual Studio 2022 Build Tools with MSVC (vswhere.exe in its documented place), Windows' tar.exe;
        `outputs` are the programs a build "produces" (target name → the lab's Linux build of it)."""
        launcher = self.root / "windows-tools"
        if not launcher.exists():
            launcher.write_text(f"#!{sys.executable}\n" + WINDOWS_TOOLS.read_text())
            launcher.chmod(0o755)
        if tar:
            self.install(f"{SYSTEM32}\\tar.exe", launcher)
        if cmake:
            self.install(f"{CMAKE_BIN}\\cmake.exe", launcher)
            self.add_to_path(CMAKE_BIN)
        if msvc:
            self.install(f"{PROGRAM_FILES_X86}\\{VSWHERE}", launcher)
            self.update_state(msvc=BUILD_TOOLS_2022)
        self.update_state(build_outputs={name: str(path) for name, path in (outputs or {}).items()})

    @property
    def processes(self) -> dict[str, str]:
        """PID → command line of the processes Start-Process started."""
        return json.loads((self.root / "state.json").read_text())["processes"]


def windows_like(lab, host, *, nvidia_smi: str = "", vulkaninfo: str = "", video=None) -> WindowsRoot:
    """Restart `host`'s sshd so that every session talks to the fake PowerShell; returns its C: drive."""
    root = host.workdir / "windows"
    root.mkdir()
    recorded = json.loads(RECORDED_CIM.read_text())
    cim = {name: value for name, value in recorded.items() if name.startswith("Win32_")}
    if video is not None:
        cim["Win32_VideoController"] = video
    state = {
        "cim": cim,
        "nvidia_smi": nvidia_smi,
        "vulkaninfo": vulkaninfo,
        "path": [SYSTEM32],
        "processes": {},
        "userprofile": USER_HOME,
    }
    (root / "state.json").write_text(json.dumps(state))
    windows = WindowsRoot(root)
    echo = root / "echo-argv.py"
    echo.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    echo.chmod(0o755)
    windows.install(f"{SYSTEM32}\\echo-argv.exe", echo)
    windows.local(USER_HOME).mkdir(parents=True)
    lab.start_sshd(host, extra_config=[f"ForceCommand {sys.executable} {FAKE_SHELL} {root}"])
    return windows
