"""Pure llama.cpp knowledge: the rpc-server banner, the -lv 4 load log, the argument lists."""

from __future__ import annotations

import pytest

from llamacpp.args import BINARIES, layer_assignment, llama_server_args, model_alias, rpc_server_args
from llamacpp.logs import (
    buffer_key,
    parse_context_log,
    parse_llama_version,
    parse_load_log,
    parse_rpc_banner,
    parse_rpc_banner_version,
    parse_server_version,
)

BANNER = """Starting RPC server v7.0.0
  endpoint       : 127.0.0.1:50061
  local cache    : n/a
Devices:
  CPU: AMD EPYC (24105 MiB, 24105 MiB free)
  transport      : TCP
Accepted client connection
"""

LOG = """\
0.00.021.332 I load_tensors: offloaded 7/9 layers to GPU
0.00.021.341 I load_tensors:   CPU_Mapped model buffer size =     2.26 MiB
0.00.021.342 I load_tensors: RPC0[127.0.0.1:50161] model buffer size =     3.19 MiB
0.00.021.343 I load_tensors: RPC0[127.0.0.1:50162] model buffer size =     3.33 MiB
0.00.021.343 I load_tensors: RPC1[127.0.0.1:50162] model buffer size =     1.00 MiB
0.00.031.070 I llama_context:        CPU  output buffer size =     0.00 MiB
0.00.031.150 I llama_kv_cache:        CPU KV buffer size =     0.50 MiB
0.00.032.099 I llama_kv_cache: RPC0[127.0.0.1:50161] KV buffer size =     0.75 MiB
0.00.032.099 I llama_kv_cache: RPC0[127.0.0.1:50161] KV buffer size =     0.25 MiB
0.00.036.629 I sched_reserve: RPC0[127.0.0.1:50161] compute buffer size =     5.01 MiB
0.00.036.635 I sched_reserve:        CPU compute buffer size =     6.52 MiB
"""


def test_rpc_banner_gives_version_endpoint_and_devices():
    info = parse_rpc_banner(BANNER)
    assert info["version"] == "7.0.0"
    assert info["endpoint"] == "127.0.0.1:50061"
    assert info["transport"] == "TCP"
    assert info["devices"] == [
        {"name": "CPU", "description": "AMD EPYC", "total_mib": 24105, "free_mib": 24105}
    ]


def test_load_log_is_keyed_by_endpoint_and_sums_buffers_of_one_device():
    parsed = parse_load_log(LOG.splitlines())
    mib = 1024 * 1024
    assert parsed["offloaded"] == [7, 9]
    devices = parsed["devices"]
    assert set(devices) == {"CPU", "127.0.0.1:50161", "127.0.0.1:50162", "127.0.0.1:50162#1"}
    assert devices["CPU"]["model"] == round(2.26 * mib)
    assert devices["CPU"]["compute"] == round(6.52 * mib)
    assert devices["127.0.0.1:50161"]["kv"] == mib  # an SWA and a full cache add up
    assert devices["127.0.0.1:50162#1"]["model"] == mib


@pytest.mark.parametrize(
    ("buffer", "key"),
    [
        ("CPU_Mapped", "CPU"),
        ("CPU_REPACK", "CPU"),
        ("AMX", "CPU"),  # the pinned build's AMX buffer type, on CPUs with AMX: repacked weights in RAM
        ("CUDA_Host", "CPU"),  # pinned host memory of the CUDA backend
        ("CUDA0", "CUDA0"),
        ("MTL0_Mapped", "MTL0"),  # a Mac's weights on Metal, mapped from the file: the GPU's, not the CPU's
        ("MTL0_Private", "MTL0"),
        ("MTL0", "MTL0"),
        ("RPC1[10.0.0.2:50052]", "10.0.0.2:50052#1"),
    ],
)
def test_every_buffer_is_counted_on_the_device_that_holds_it(buffer, key):
    assert buffer_key(buffer) == key


def test_server_args_put_rpc_before_device_and_count_the_output_slot():
    placements = [
        {"llama_device": "CPU", "endpoint": None, "layers": 2, "output_layer": False},
        {"llama_device": "RPC0", "endpoint": "10.0.0.2:50052", "layers": 3, "output_layer": False},
        {"llama_device": "RPC1", "endpoint": "10.0.0.3:50052", "layers": 1, "output_layer": False},
        {"llama_device": "CUDA0", "endpoint": None, "layers": 2, "output_layer": True},
    ]
    args = llama_server_args(placements, {"ctx": 4096, "parallel": 1, "cache_type": "f16"}, 8)
    assert args[:10] == [
        "--rpc", "10.0.0.2:50052,10.0.0.3:50052", "--device", "RPC0,RPC1,CUDA0", "-ngl", "7", "-ts", "3,1,3",
        "-sm", "layer",
    ]  # fmt: skip
    assert layer_assignment([3, 1, 3], 8, 7) == [-1, -1, 0, 0, 0, 1, 2, 2, 2]
    assert rpc_server_args("10.0.0.9", 50052, ["MTL0"]) == [
        "-H",
        "10.0.0.9",
        "-p",
        "50052",
        "-d",
        "MTL0",
    ]


def test_everything_on_the_cpu_lists_no_device():
    placements = [{"llama_device": "CPU", "endpoint": None, "layers": 8, "output_layer": True}]
    args = llama_server_args(placements, {"ctx": 512, "parallel": 1, "cache_type": "q8_0"}, 8)
    assert args[:4] == ["--device", "none", "-ngl", "0"]
    assert "-ts" not in args


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("version: 4567 (a1b2c3d4)\nbuilt with cc 11.4.0 for x86_64-linux-gnu", ("4567", "a1b2c3d4")),
        ("version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU 12.2.0", ("0.6.0-dev", "")),
        ("version: 0.7.1 (build 7001, commit 0fa2b7c)", ("0.7.1", "0fa2b7c")),
        ("error while loading shared libraries: libggml.so", ("", "")),
    ],
)
def test_llama_server_version_lines(output, expected):
    assert parse_llama_version(output) == expected


def test_the_server_version_label_is_the_version_line_as_printed():
    assert parse_server_version("version: 6800 (abc1234)\nbuilt with cc") == "6800 (abc1234)"
    new = "load_backend: loaded CPU backend\nversion: 0.6.0-dev (build 0, commit unknown)\n"
    assert parse_server_version(new) == "0.6.0-dev (build 0, commit unknown)"
    assert parse_server_version("llama-server: not found") == ""


def test_the_rpc_banner_version_alone():
    assert parse_rpc_banner_version(BANNER) == "7.0.0"
    assert parse_rpc_banner_version("Starting RPC server v3.1.0\n  endpoint : 127.0.0.1:1") == "3.1.0"
    assert parse_rpc_banner_version("usage: ggml-rpc-server [options]") == ""


def test_every_llamacpp_binary_name_comes_from_one_place():
    from llamacpp import reaper
    from nodes.probe import parse as probe

    assert BINARIES == ("ggml-rpc-server", "rpc-server", "llama-server")
    assert set(reaper.OUR_PROGRAMS) == set(BINARIES)
    assert probe.BINARIES is BINARIES


# The pinned release's llama-server -lv 4, asked for -c 2048 -np 1 on a model trained on 1024 (run here).
CAPPED_LOG = """\
0.00.011.389 I print_info: n_ctx_train           = 1024
0.00.012.662 I print_info: n_ctx_orig_yarn       = 1024
0.00.017.276 I llama_context: n_seq_max             = 1
0.00.017.288 I llama_context: n_ctx                 = 2048
0.00.017.299 I llama_context: n_ctx_seq             = 2048
0.00.017.452 W llama_context: n_ctx_seq (2048) > n_ctx_train (1024) -- possible training context overflow
0.00.104.885 W srv    load_model: the slot context (2048) exceeds the training context of the model (1024) - \
capping
0.00.105.289 I srv    load_model: initializing, n_slots = 1, n_ctx_slot = 1024, kv_unified = 'false'
0.00.105.342 I slot   load_model: id  0 | task -1 | new slot, n_ctx = 1024
0.00.190.000 D slot decode token, id=0, n_ctx = 9999, n_tokens = 3, truncated = 0
"""


def test_the_context_llama_cpp_capped_at_the_trained_one_is_the_one_reported():
    context = parse_context_log(CAPPED_LOG.splitlines())
    assert context == {
        "n_ctx": 2048,
        "n_ctx_train": 1024,
        "n_slots": 1,
        "per_slot": 1024,
        "total": 1024,
        "capped": True,
    }


def test_the_context_of_several_slots_is_their_sum_and_rounding_is_not_a_cap():
    log = [
        "llama_context: n_seq_max             = 2",
        "llama_context: n_ctx                 = 1024",
        "llama_context: n_ctx_seq             = 512",
        "llama_context: n_ctx_seq (512) < n_ctx_train (2048) -- the full capacity ... will not be utilized",
        "srv    load_model: initializing, n_slots = 2, n_ctx_slot = 512, kv_unified = 'false'",
    ]
    context = parse_context_log(log)
    assert (context["total"], context["per_slot"], context["n_slots"], context["capped"]) == (
        1024,
        512,
        2,
        False,
    )
    assert (
        context["n_ctx_train"] is None
    )  # only printed as "n_ctx_train      = N", not in the comparison line


def test_an_older_llama_server_log_gives_the_context_from_its_slot_lines():
    log = [
        "llm_load_print_meta: n_ctx_train      = 2048",
        "llama_new_context_with_model: n_ctx      = 4096",
        "llama_new_context_with_model: n_ctx_per_seq = 4096",
        "slot   load_model: id  0 | task -1 | new slot n_ctx_slot = 2048",
    ]
    context = parse_context_log(log)
    assert (context["total"], context["n_slots"], context["n_ctx_train"], context["capped"]) == (
        2048,
        1,
        2048,
        True,
    )


def test_a_log_without_context_lines_reports_nothing():
    assert parse_context_log(["load_tensors: offloaded 9/9 layers to GPU"])["total"] is None


@pytest.mark.parametrize(
    ("name", "alias"),
    [("tiny-llama-demo", "tiny-llama-demo"), ("Qwen 2.5, 7B", "Qwen 2.5 7B"), ("  ", "model")],
)
def test_the_model_alias_is_the_console_name_as_one_alias(name, alias):
    assert model_alias(name) == alias


def test_weights_repacked_for_amx_are_the_cpus_and_counted_as_repacked():
    # As the pinned build logs an f16 model's CPU blocks on a Xeon with AMX.
    lines = [
        "load_tensors:          AMX model buffer size =   131.25 MiB",
        "load_tensors:   CPU_Mapped model buffer size =    31.35 MiB",
        "load_tensors: RPC0[10.77.2.2:50052] model buffer size =   395.15 MiB",
    ]
    cpu = parse_load_log(lines)["devices"]["CPU"]
    assert cpu["model"] == round(162.6 * 2**20) and cpu["repacked"] == round(131.25 * 2**20)
