"""The Windows build's decisions (builds/windows.py): what PowerShell found, which compiler and generator,
and what a person is told to install."""

from __future__ import annotations

from builds.windows import (
    bin_dir_of,
    compiler_of,
    generator_flags,
    missing,
    missing_sentence,
    parse_build_tools,
    windows_backend,
)

ANSWER = """@@@ commands
C:\\Program Files\\CMake\\bin\\cmake.exe
C:\\Windows\\System32\\tar.exe
C:\\Program Files\\LLVM\\bin\\clang.exe
C:\\Program Files\\LLVM\\bin\\clang++.exe
@@@ msvc
C:\\Program Files (x86)\\Microsoft Visual Studio\\2022\\BuildTools
@@@ vulkan_sdk
@@@ home
C:\\Users\\ana
@@@ end
"""


def test_what_powershell_found_is_read_by_program_name():
    found = parse_build_tools(ANSWER)
    assert found["cmake"] == "C:\\Program Files\\CMake\\bin\\cmake.exe"
    assert found["clang++"].endswith("clang++.exe") and "git" not in found and "vulkan_sdk" not in found
    assert found["msvc"].endswith("BuildTools") and found["home"] == "C:\\Users\\ana"


def test_visual_studio_comes_first_and_builds_into_bin_release():
    found = parse_build_tools(ANSWER)
    assert compiler_of(found) == "msvc" and generator_flags(found) == []
    assert bin_dir_of("C:\\b", found) == "C:\\b\\bin\\Release"


def test_clang_builds_with_ninja_only_and_says_so_when_ninja_is_missing():
    found = {"cmake": "c", "tar": "t", "clang": "x", "clang++": "y"}
    assert compiler_of(found) == ""
    assert missing(found, source="tarball", backend="cpu") == [
        ("Ninja, to build with the clang on the PATH", "ninja")
    ]
    found["ninja"] = "n"
    assert generator_flags(found) == [
        "-G",
        "Ninja",
        "-DCMAKE_C_COMPILER=clang",
        "-DCMAKE_CXX_COMPILER=clang++",
    ]
    assert bin_dir_of("C:\\b", found) == "C:\\b\\bin"


def test_each_missing_piece_is_named_with_the_winget_command():
    lacks = missing({}, source="git", backend="vulkan")
    sentence = missing_sentence("gaming-pc", "vulkan", lacks)
    for command in (
        "winget install -e --id Kitware.CMake",
        "winget install -e --id Microsoft.VisualStudio.2022.BuildTools",
        "winget install -e --id Git.Git",
        "winget install -e --id KhronosGroup.VulkanSDK",
    ):
        assert command in sentence
    assert len(sentence) <= 500  # a job's result
    assert missing({"cmake": "c", "msvc": "v"}, source="git", backend="cuda") == [
        ("git", "git"),
        ("nvcc, the CUDA toolkit, for the NVIDIA GPU", "cuda"),
    ]
    assert (
        "builds on Linux only"
        in missing({"cmake": "c", "msvc": "v"}, source="existing", backend="rocm")[0][0]
    )


def test_the_backend_follows_the_pcs_gpus():
    assert windows_backend("auto", {}, {"cpu", "cuda"}) == "cuda"
    assert windows_backend("auto", {}, {"cpu", "vulkan"}) == "vulkan"
    assert windows_backend("auto", {}, {"cpu"}) == "cpu"
    assert windows_backend("vulkan", {}, {"cpu", "cuda"}) == "vulkan"
