"""The build job: its pure decisions, and registering the existing llama.cpp install on a lab host."""

from __future__ import annotations

import pytest

from deployments.build_job import (
    cache_has_flags,
    choose_backend,
    cmake_flags,
    missing_prerequisites,
    parse_prerequisites,
    parse_rpc_banner_version,
    parse_rpc_protocol_header,
    parse_server_version,
    protocol_mismatch,
    rpc_target_of,
    src_dir_name,
)
from jobs.models import Job, JobKind, JobState
from nodes.models import Build, BuildSource
from tests.deploy_fixtures import BUILD_DIR, RPC_SERVER, lab_node, log_text, run

LINUX_ALL = """\
cmake=/usr/bin/cmake
ninja=/usr/bin/ninja
make=/usr/bin/make
c++=/usr/bin/c++
g++=/usr/bin/g++
clang++=
cc=/usr/bin/cc
tar=/usr/bin/tar
git=/usr/bin/git
nvcc=
flock=/usr/bin/flock
nproc=/usr/bin/nproc
os=Linux
arch=x86_64
home=/root
xcode=
"""

MAC_NO_CLT = """\
cmake=/opt/homebrew/bin/cmake
ninja=
make=/usr/bin/make
c++=
g++=
clang++=
tar=/usr/bin/tar
git=
os=Darwin
arch=arm64
home=/Users/leonie
xcode=
"""


def test_a_complete_linux_node_lacks_nothing():
    found = parse_prerequisites(LINUX_ALL)
    assert missing_prerequisites(found, source="tarball", backend="cpu") == []
    assert found["home"] == "/root"


def test_missing_tools_are_named_as_a_person_installs_them():
    found = parse_prerequisites(MAC_NO_CLT)
    missing = missing_prerequisites(found, source="git", backend="metal")
    assert "a C++ compiler (g++ or clang++)" in missing
    assert "git" in missing
    assert "Xcode command line tools (xcode-select --install)" in missing
    assert "cmake" not in missing


def test_an_nvidia_node_needs_nvcc():
    found = parse_prerequisites(LINUX_ALL)
    assert choose_backend("auto", found, {"cuda", "cpu"}) == "cuda"
    assert missing_prerequisites(found, source="tarball", backend="cuda") == [
        "nvcc (the CUDA toolkit) for the NVIDIA GPU"
    ]


def test_backend_choice_and_flags():
    assert choose_backend("auto", {"os": "Darwin"}, set()) == "metal"
    assert choose_backend("auto", {"os": "Linux"}, {"cpu"}) == "cpu"
    assert choose_backend("vulkan", {"os": "Linux"}, {"cpu"}) == "vulkan"
    flags = cmake_flags("cuda")
    assert "-DGGML_RPC=ON" in flags and "-DGGML_CUDA=ON" in flags and "-DLLAMA_CURL=OFF" in flags
    assert "-DGGML_CUDA=ON" not in cmake_flags("metal")


@pytest.mark.skipif(not (BUILD_DIR / "CMakeCache.txt").exists(), reason="no cached llama.cpp build")
def test_the_cached_build_already_holds_the_cpu_flags_but_not_cuda():
    cache = (BUILD_DIR / "CMakeCache.txt").read_text()
    assert cache_has_flags(cache, cmake_flags("cpu"))
    assert not cache_has_flags(cache, cmake_flags("cuda"))


def test_versions_and_protocols_are_read_from_their_sources():
    header = (
        "#define RPC_PROTO_MAJOR_VERSION    7\n#define RPC_PROTO_MINOR_VERSION    0\n"
        "#define RPC_PROTO_PATCH_VERSION    0\n"
    )
    assert parse_rpc_protocol_header(header) == "7.0.0"
    assert parse_rpc_protocol_header("#define RPC_PROTO_MAJOR_VERSION 3\n") == ""
    assert parse_rpc_banner_version("Starting RPC server v3.1.0\n  endpoint : 127.0.0.1:1") == "3.1.0"
    assert parse_server_version("version: 6800 (abc1234)\nbuilt with cc") == "6800 (abc1234)"
    assert (
        rpc_target_of("set(TARGET ggml-rpc-server)\nadd_executable(${TARGET} rpc-server.cpp)")
        == "ggml-rpc-server"
    )
    assert rpc_target_of("set(TARGET rpc-server)\nadd_executable(${TARGET} rpc-server.cpp)") == "rpc-server"
    assert src_dir_name("b0a2feb64c6fbd09" + "0" * 48) == "src-b0a2feb64c6fbd09"


def test_different_rpc_protocols_are_refused_by_name():
    assert protocol_mismatch({"desk": "7.0.0", "mac": "7.0.0"}) == ""
    reason = protocol_mismatch({"desk": "7.0.0", "old-pc": "3.0.0"})
    assert "old-pc speaks 3.0.0" in reason and "desk speaks 7.0.0" in reason


@pytest.mark.lab
@pytest.mark.llamacpp
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_an_existing_install_is_registered_after_running_it(lab, lab_host):
    if not RPC_SERVER.exists():
        pytest.skip("no cached llama.cpp build")
    node = lab_node(lab, lab_host)
    job = run(
        Job.objects.create(
            kind=JobKind.BUILD, node=node, params={"source": "existing", "path": str(RPC_SERVER.parent)}
        )
    )
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job))
    build = Build.objects.get(node=node)
    assert build.source_kind == BuildSource.EXISTING
    assert (build.rpc_binary, build.rpc_protocol) == ("ggml-rpc-server", "7.0.0")
    assert build.llama_server_path.endswith("/llama-server")
    assert build.version
    assert node.current_build == build


@pytest.mark.lab
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_path_without_llama_cpp_is_refused(lab, lab_host, tmp_path):
    node = lab_node(lab, lab_host)
    job = run(
        Job.objects.create(
            kind=JobKind.BUILD, node=node, params={"source": "existing", "path": str(tmp_path)}
        )
    )
    assert job.state == JobState.FAILED
    assert "holds no ggml-rpc-server/rpc-server and llama-server" in job.result
    assert not Build.objects.exists()
