"""The `verify` and `measure` steps: did llama.cpp place the layers as planned, and how fast it decodes."""

from __future__ import annotations

import asyncio
import json

import httpx
from django.conf import settings

from deployments.endpoint import endpoint_url
from deployments.steps.common import load_deployment
from deployments.steps.llama_server import llama_process
from jobs.aio import db
from jobs.context import JobFailed
from llamacpp import rpc_guard
from llamacpp.logs import parse_context_log
from planning import placement
from remote.bounded_http import AnswerTooLarge, fetch

MEASURE_PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a short story about a fox:"


MEASURE_TOKENS = 32


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


async def measure_body(ctx) -> str:
    deployment = await load_deployment(ctx)
    key = await db(deployment.api_key)()
    url = endpoint_url(deployment)
    body = {"prompt": MEASURE_PROMPT, "n_predict": MEASURE_TOKENS, "cache_prompt": False}
    async with httpx.AsyncClient(timeout=600.0) as client:
        try:
            # Read with a bound: 32 tokens and their timings are a few kB, whatever the node sends.
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
    predicted = (deployment.plan or {}).get("predicted_tokens_per_s")
    await db(deployment.record)(
        measured_decode_tps=decode, measured_prompt_tps=prompt, predicted_decode_tps=predicted
    )
    error = deployment.speed_error
    off = f" ({error:+.0%} against the prediction)" if error is not None else ""
    await ctx.log(
        f"decode {decode:.1f} tokens/s (predicted {predicted or 0:.1f}){off}; prompt {prompt:.1f} tokens/s"
    )
    advice = await db(deployment.recalibration_advice)()
    if advice:
        await ctx.log(f"The prediction is off by more than 25%: calibrate {', '.join(advice)} again.")
    return f"decode {decode:.1f} tok/s (predicted {predicted or 0:.1f}), prompt {prompt:.1f} tok/s"
