"""The `verify` and `measure` steps: did llama.cpp place the layers as planned, and how fast it decodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics

import httpx
from django.conf import settings

from deployments.endpoint import endpoint_url
from deployments.steps.common import load_deployment
from deployments.steps.llama_server import llama_process
from jobs.aio import db, open_transport_for
from jobs.context import JobFailed
from llamacpp import rpc_guard
from llamacpp.logs import parse_context_log
from nodes.models import Node
from planning import first_word, placement, speed_check
from remote.base import TransportError
from remote.bounded_http import AnswerTooLarge, fetch

MEASURE_PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a short story about a fox:"


# The measurement: a fixed length (ignore_eos: a model that stops early measures nothing useful), from an
# empty cache, several times, the median kept.
MEASURE_TOKENS = 128


MEASURE_SAMPLES = 3


# llama-server writes its log from a thread of its own: on a busy machine the lines of the load (with -lv 4,
# thousands of them) can reach the file seconds after /health already answers. How long verify waits for them.
LOAD_REPORT_WAIT_S = 30.0
LOAD_REPORT_PATTERN = "buffer size|offloaded|n_ctx|n_seq_max|n_slots|training context"


async def read_load_report(transport, log_path: str, *, wait: float = LOAD_REPORT_WAIT_S) -> str:
    """The lines of llama-server's log that say where llama.cpp put what, once its buffer sizes are in the
    file (or what is there after `wait` seconds: the comparison then says what is missing)."""
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        result = await transport.run(["grep", "-E", LOAD_REPORT_PATTERN, log_path], timeout=60)
        text = "\n".join(line.text for line in result.lines if line.stream == "out")
        if "buffer size" in text or asyncio.get_running_loop().time() >= deadline:
            return text
        await asyncio.sleep(0.5)


async def verify_body(ctx) -> str:
    deployment = await load_deployment(ctx)
    info = llama_process(deployment)
    log_text = await read_load_report(ctx.transport, info["log"])
    log_text = rpc_guard.planned_endpoints_in(log_text, info.get("local_ends") or {})
    report = placement.compare(deployment.plan, log_text)
    for line in report["lines"]:
        await ctx.log(line)
    # The context llama.cpp really gave the slots is the one shown from now on, beside the one asked for.
    report["context"] = context = parse_context_log(log_text.splitlines())
    await db(deployment.record)(verification=report, ctx_used=context["total"])
    if context["total"] is not None and context["total"] != deployment.ctx_requested:
        await ctx.log(
            f"context: llama.cpp uses {context['total']} tokens ({context['per_slot']} per slot), "
            f"{deployment.ctx_requested} were asked for; {deployment.ctx_note()}"
        )
    if report["problems"]:
        message = "placement differs from the plan: " + "; ".join(report["problems"])
        if getattr(settings, "RAMDECK_PLACEMENT_MISMATCH", "fail") == "fail":
            raise JobFailed(message)
        await ctx.log("WARNING: " + message)
        return "placement differs from the plan (warned, not failed)"
    return f"placement matches the plan on {len(report['devices'])} device(s)"


async def _completion(client, url: str, key: str) -> dict:
    """One measurement: MEASURE_TOKENS decoded whatever the model wants, from an empty cache; the timings."""
    body = {"prompt": MEASURE_PROMPT, "n_predict": MEASURE_TOKENS, "ignore_eos": True, "cache_prompt": False}
    try:
        # Read with a bound: 128 tokens and their timings are a few kB, whatever the node sends.
        status, raw = await fetch(
            client,
            "POST",
            f"{url}/completion",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            what="/completion answer",
        )
    except AnswerTooLarge as exc:
        raise JobFailed(f"{exc}; cannot measure") from None
    text = raw.decode("utf-8", "replace")
    if status != 200:
        raise JobFailed(f"POST /completion answered {status}: {text[:300]}")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise JobFailed(f"llama-server's /completion answer is not a JSON object: {text[:200]!r}")
    timings = answer.get("timings") or {}
    decode = timings.get("predicted_per_second")
    prompt = timings.get("prompt_per_second")
    if not isinstance(decode, int | float) or not isinstance(prompt, int | float):
        # An older or differently built llama-server may answer without timings: say so, not a TypeError.
        raise JobFailed(
            "llama-server answered /completion without speed timings "
            f"(predicted_per_second={decode!r}, prompt_per_second={prompt!r}); cannot measure"
        )
    decoded = timings.get("predicted_n")
    if isinstance(decoded, int) and decoded < MEASURE_TOKENS:
        raise JobFailed(
            f"llama-server decoded {decoded} tokens where {MEASURE_TOKENS} were asked for (ignore_eos): "
            "too few to measure"
        )
    return timings


# The first token after a long prompt (issue 20): a prompt of PROMPT_TOKENS tokens (fewer when a slot's
# context is smaller), sent as token ids so that its length is exact, from an empty cache, twice.
TTFT_SAMPLES = 2
TTFT_TEXT = " ".join(
    f"Note {i}: the {w} of the household's shared machines, and what each of them holds."
    for i, w in enumerate(["memory", "disk", "network", "model", "console", "worker"] * 40)
)


async def _post_json(client, url: str, key: str, path: str, body: dict) -> dict:
    try:
        status, raw = await fetch(
            client, "POST", f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"},
            what=f"{path} answer",
        )  # fmt: skip
    except AnswerTooLarge as exc:
        raise JobFailed(f"{exc}; cannot measure") from None
    except httpx.HTTPError as exc:
        raise JobFailed(f"POST {path} failed: {exc or type(exc).__name__}") from None
    text = raw.decode("utf-8", "replace")
    if status != 200:
        raise JobFailed(f"POST {path} answered {status}: {text[:300]}")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise JobFailed(f"llama-server's {path} answer is not a JSON object: {text[:200]!r}")
    return answer


def prompt_length(deployment) -> int:
    """The prompt the first token is measured after: the plan's (planning/first_word.py `prompt_tokens`), or
    what one slot's context as llama.cpp gave it holds with room for the token it answers."""
    settings_ = (deployment.plan or {}).get("settings") or {}
    planned = ((deployment.plan or {}).get("first_word") or {}).get(
        "prompt_tokens"
    ) or first_word.PROMPT_TOKENS
    per_slot = (deployment.ctx_used or settings_.get("ctx") or planned) // max(
        1, int(settings_.get("parallel") or 1)
    )
    return max(16, min(planned, per_slot - 16))


async def measure_first_token(client, url: str, key: str, n_tokens: int) -> tuple[int, list[float]]:
    """(prompt tokens, seconds to the first token of each sample), timed here from the request to the
    answer with its one token."""
    tokens = (await _post_json(client, url, key, "/tokenize", {"content": TTFT_TEXT})).get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise JobFailed("llama-server's /tokenize answer carried no tokens; cannot measure the first token")
    prompt = (tokens * (n_tokens // len(tokens) + 1))[:n_tokens]
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False}
    seconds = []
    loop = asyncio.get_running_loop()
    for _ in range(TTFT_SAMPLES):
        start = loop.time()
        answer = await _post_json(client, url, key, "/completion", body)
        seconds.append(loop.time() - start)
    n = (answer.get("timings") or {}).get("prompt_n")
    return (n if isinstance(n, int) and n > 0 else n_tokens), seconds


def _proc_paths(pid: int) -> list[str]:
    return ["/proc/loadavg", "/proc/stat", f"/proc/{int(pid)}/stat"]


async def _read_proc(ctx, pid: int | None) -> dict:
    """The node's load and CPU time, and llama-server's, from Linux's /proc ({} elsewhere)."""
    if ctx.node.platform != "linux" or not pid:
        return {}
    result = await ctx.transport.run(["cat", *_proc_paths(pid)], timeout=30)
    return speed_check.parse_proc(result.stdout) if result.ok else {}


def _worker_pids(deployment) -> dict[str, int]:
    """Each worker's rpc-server PID by node name, as the rpc_server steps recorded them (the coordinator's
    own load is read apart)."""
    coordinator = deployment.coordinator.name
    return {
        info["node"]: int(info["pid"])
        for info in (deployment.processes or {}).values()
        if info.get("role") == "rpc-server" and info.get("pid") and info.get("node") != coordinator
    }


async def _open_workers(stack: contextlib.AsyncExitStack, deployment) -> dict[str, tuple]:
    """An SSH connection to each Linux worker of the deployment, with its rpc-server's PID: their load is
    read over the same samples as the coordinator's (a busy worker is a cause a miss can name). A worker
    that cannot be reached is left out; the measurement goes on."""
    pids = await db(_worker_pids)(deployment)
    nodes = await db(lambda: {n.name: n for n in Node.objects.filter(name__in=list(pids))})()
    out = {}
    for name, pid in pids.items():
        node = nodes.get(name)
        if node is None or node.platform != "linux":
            continue
        with contextlib.suppress(TransportError, OSError):
            out[name] = (await stack.enter_async_context(await open_transport_for(node)), pid)
    return out


async def _read_workers(workers: dict[str, tuple]) -> dict[str, dict]:
    readings = {}
    for name, (transport, pid) in workers.items():
        with contextlib.suppress(TransportError, OSError):
            result = await transport.run(["cat", *_proc_paths(pid)], timeout=30)
            if result.ok:
                readings[name] = speed_check.parse_proc(result.stdout)
    return readings


async def measure_body(ctx) -> str:
    deployment = await load_deployment(ctx)
    key = await db(deployment.api_key)()
    url = endpoint_url(deployment)
    pid = next(
        (p.get("pid") for p in (deployment.processes or {}).values() if p.get("role") == "llama-server"), None
    )
    samples = []
    async with httpx.AsyncClient(timeout=600.0) as client, contextlib.AsyncExitStack() as stack:
        workers = await _open_workers(stack, deployment)
        before = await _read_proc(ctx, pid)
        workers_before = await _read_workers(workers)
        for _ in range(MEASURE_SAMPLES):
            samples.append(await _completion(client, url, key))
        after = await _read_proc(ctx, pid)
        workers_after = await _read_workers(workers)
        try:
            n_prompt, ttft_samples = await measure_first_token(client, url, key, prompt_length(deployment))
        except JobFailed as exc:
            # Decode speed is what the step is for; a first token it could not time is said, not fatal.
            await ctx.log(f"first token not measured: {exc.reason}")
            n_prompt, ttft_samples = prompt_length(deployment), []
    decode = statistics.median(t["predicted_per_second"] for t in samples)
    prompt = statistics.median(t["prompt_per_second"] for t in samples)
    prompt_n = samples[0].get("prompt_n")
    filled = speed_check.filled_context(prompt_n, MEASURE_TOKENS) if isinstance(prompt_n, int) else None
    plan = deployment.plan or {}
    predicted, at_filled = speed_check.predicted_at(plan, filled)
    check = {
        "tokens": MEASURE_TOKENS,
        "samples": [round(t["predicted_per_second"], 2) for t in samples],
        "filled": filled,
        "kv_cells": plan.get("kv_cells") or (plan.get("settings") or {}).get("ctx"),
        "predicted_full": plan.get("predicted_tokens_per_s"),
        "at_filled_context": at_filled,
        "cpu_use": speed_check.cpu_use(before, after),
        # Each Linux worker's, its rpc-server's CPU time as "own".
        "workers_cpu_use": {
            name: use
            for name in workers_after
            if (use := speed_check.cpu_use(workers_before.get(name, {}), workers_after[name]))
        },
    }
    figures = plan.get("first_word") or {}
    ttft = statistics.median(ttft_samples) if ttft_samples else None
    ttft_predicted = first_word.ttft_at(figures, n_prompt)
    info = next((p for p in (deployment.processes or {}).values() if p.get("role") == "llama-server"), {})
    kind = await db(deployment.load_kind)()
    load_predicted = (figures.get("load") or {}).get(f"{kind}_s")
    measured_first = {
        "prompt_tokens": n_prompt,
        "ttft_s": None if ttft is None else round(ttft, 3),
        "ttft_samples": [round(s, 3) for s in ttft_samples],
        "ttft_predicted_s": None if ttft_predicted is None else round(ttft_predicted, 3),
        "ttft_error": first_word.error(ttft, ttft_predicted),
        "load_s": info.get("load_s"),
        "load_kind": kind,
        "load_predicted_s": load_predicted,
        "load_error": first_word.error(info.get("load_s"), load_predicted),
    }
    verification = {**(deployment.verification or {}), "speed": check, "first_word": measured_first}
    await db(deployment.record)(
        measured_decode_tps=decode,
        measured_prompt_tps=prompt,
        predicted_decode_tps=predicted,
        verification=verification,
    )
    error = deployment.speed_error
    off = f" ({error:+.0%} against the prediction)" if error is not None else ""
    where = (
        f" at the {filled:.0f} tokens of context it filled" if at_filled else " at the plan's full context"
    )
    await ctx.log(
        f"decode {decode:.1f} tokens/s, the median of {len(samples)} runs of {MEASURE_TOKENS} tokens "
        f"({', '.join(f'{s:.1f}' for s in check['samples'])}); predicted {predicted or 0:.1f}{where}{off}; "
        f"prompt {prompt:.1f} tokens/s"
    )
    if check["cpu_use"]:
        use = check["cpu_use"]
        await ctx.log(
            f"{ctx.node.name} while it decoded: llama-server used {use['own_cpus']:.1f} of its "
            f"{use['cpus']} CPUs, other programs {use['others_cpus']:.1f}"
        )
    reasons = await db(deployment.speed_miss_reasons)()
    if reasons:
        await ctx.log(
            f"The prediction is off by more than {speed_check.SPEED_ERROR_LIMIT:.0%}. Likely: "
            + "; ".join(f"{row['node']}: {row['reason']}" for row in reasons)
        )
    # The first word's figures, after decode's.
    if ttft is not None:
        await ctx.log(
            f"first token after a prompt of {n_prompt} tokens: {ttft:.2f} s "
            f"({', '.join(f'{s:.2f}' for s in ttft_samples)}); predicted "
            + (
                f"{ttft_predicted:.2f} s"
                if ttft_predicted is not None
                else "nothing (a plan before issue 20)"
            )
        )
    if info.get("load_s") is not None:
        await ctx.log(
            f"load ({kind}: {'its workers had it before' if kind == 'warm' else 'first load'}): "
            f"{info['load_s']:.1f} s from llama-server's start to its health answer; predicted "
            + (f"{load_predicted:.1f} s" if load_predicted is not None else "nothing")
        )
    for what, value in (
        ("first token", measured_first["ttft_error"]),
        ("load", measured_first["load_error"]),
    ):
        if first_word.is_off(value):
            await ctx.log(
                f"The {what} prediction is off by {value:+.0%} (more than {first_word.ERROR_LIMIT:.0%})."
            )
    return f"decode {decode:.1f} tok/s (predicted {predicted or 0:.1f}), prompt {prompt:.1f} tok/s" + (
        f", first token after {n_prompt} tokens {ttft:.2f} s" if ttft is not None else ""
    )
