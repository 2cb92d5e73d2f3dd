"""Building llama.cpp from source on a Windows node, through real SSH against the fake PC
(tests/lab/windows_host.py): the build job asks PowerShell for CMake, the compiler (vswhere.exe), tar.exe and
git, names what is missing with the winget and Chocolatey commands, uploads the source tarball over SFTP,
unpacks it with tar.exe, runs cmake's configure and build with the POSIX path's flags, and registers the
rpc-server.exe it produced from its banner. The fake's cmake cannot compile: it checks what CMake checks,
writes the cache and puts the lab's Linux build where Visual Studio's generator puts the .exe
(tests/lab/windows_tools.py)."""

from __future__ import annotations

import io
import tarfile

import pytest

from builds.backends import COMMON_FLAGS
from builds.models import Build, BuildSource
from jobs.models import Job, JobState
from tests.deploy_fixtures import lab_node, log_text, run
from tests.lab.windows_host import USER_HOME, windows_like
from tests.llamacpp_build import require_llamacpp

pytestmark = [pytest.mark.lab, pytest.mark.timeout(300)]

RPC_HEADER = "".join(
    f"#define RPC_PROTO_{part}_VERSION {n}\n" for part, n in (("MAJOR", 3), ("MINOR", 0), ("PATCH", 0))
)


def _source_tarball(folder) -> str:
    """A llama.cpp-shaped source tarball (what CMake and the job look at) in the console's tarball folder."""
    files = {
        "llama.cpp-b9999/CMakeLists.txt": "project(llama.cpp)\n",
        "llama.cpp-b9999/tools/rpc/CMakeLists.txt": "set(TARGET ggml-rpc-server)\n",
        "llama.cpp-b9999/ggml/include/ggml-rpc.h": RPC_HEADER,
    }
    path = folder / "llama.cpp-b9999.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture
def tarball(settings, tmp_path):
    folder = tmp_path / "tarballs"
    folder.mkdir()
    settings.RAMDECK_TARBALL_DIR = str(folder)
    return _source_tarball(folder)


@pytest.mark.django_db(transaction=True)
def test_a_windows_pc_without_cmake_or_a_compiler_is_told_what_to_install(lab, lab_host, tarball):
    drive = windows_like(lab, lab_host)
    node = lab_node(lab, lab_host)
    assert run(Job.objects.create(kind="probe", node=node)).state == JobState.SUCCEEDED

    job = run(Job.objects.create(kind="build", node=node, params={"source": "tarball", "tarball": tarball}))

    assert job.state == JobState.FAILED
    assert "lacks what the cpu build needs on Windows" in job.result
    assert "CMake (`winget install -e --id Kitware.CMake`)" in job.result
    assert "Visual Studio 2022 Build Tools with the C++ workload" in job.result
    assert "winget install -e --id Microsoft.VisualStudio.2022.BuildTools" in job.result
    assert "choco install visualstudio2022buildtools visualstudio2022-workload-vctools" in log_text(job)
    assert "choco install cmake" in log_text(job)
    # Windows ships tar.exe; this PC's System32 has none either, and the job says so.
    assert "tar.exe" in job.result
    assert not Build.objects.filter(node=node).exists()
    # Nothing was uploaded before the check.
    assert not drive.local(f"{USER_HOME}\\.ramdeck\\llama.cpp").exists()

    # CMake and tar now, still no compiler: only the compiler is named.
    drive.install_build_tools(msvc=False)
    again = run(Job.objects.create(kind="build", node=node, params={"source": "tarball", "tarball": tarball}))
    assert again.state == JobState.FAILED
    assert "Kitware.CMake" not in again.result and "tar.exe" not in again.result
    assert "a C++ compiler" in again.result and "Microsoft.VisualStudio.2022.BuildTools" in again.result


@pytest.mark.llamacpp
@pytest.mark.django_db(transaction=True)
def test_llama_cpp_is_built_from_source_on_a_windows_pc_and_registered_from_its_banner(
    lab, lab_host, tarball
):
    tools = require_llamacpp()
    drive = windows_like(lab, lab_host)
    drive.install_build_tools(
        outputs={"ggml-rpc-server": tools.rpc_server, "llama-server": tools.llama_server}
    )
    node = lab_node(lab, lab_host)
    assert run(Job.objects.create(kind="probe", node=node)).state == JobState.SUCCEEDED
    node.refresh_from_db()

    job = run(Job.objects.create(kind="build", node=node, params={"source": "tarball", "tarball": tarball}))

    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job))
    log = log_text(job)
    assert "compiler msvc" in log and "uploading llama.cpp-b9999.tar.gz" in log
    build = Build.objects.get(node=node)
    tree = f"{USER_HOME}\\.ramdeck\\llama.cpp\\src-{build.tarball_sha256[:16]}"
    assert (build.source_kind, build.backend, build.source) == (
        BuildSource.TARBALL,
        "cpu",
        "llama.cpp-b9999.tar.gz",
    )
    assert build.build_dir == f"{tree}\\build-cpu"
    assert build.rpc_server_path == f"{tree}\\build-cpu\\bin\\Release\\ggml-rpc-server.exe"
    assert build.llama_server_path == f"{tree}\\build-cpu\\bin\\Release\\llama-server.exe"
    assert build.rpc_protocol and build.version and build.devices[0]["name"] == "CPU"
    # The POSIX path's flags, GGML_RPC=ON first; the cache CMake wrote holds them.
    assert build.flags[: len(COMMON_FLAGS)] == COMMON_FLAGS and "-DGGML_RPC=ON" in build.flags
    cache = drive.local(f"{tree}\\build-cpu\\CMakeCache.txt").read_text()
    assert "GGML_RPC:STRING=ON" in cache and "CMAKE_GENERATOR:INTERNAL=Visual Studio 17 2022" in cache
    assert drive.local(f"{USER_HOME}\\.ramdeck\\llama.cpp\\dl\\llama.cpp-b9999.tar.gz").is_file()

    # Built again with the same flags: the cache is used, nothing is uploaded or compiled.
    again = run(Job.objects.create(kind="build", node=node, params={"source": "tarball", "tarball": tarball}))
    assert again.state == JobState.SUCCEEDED, (again.result, log_text(again))
    assert "already unpacked on the node" in log_text(again)
    assert "nothing to compile" in log_text(again)
