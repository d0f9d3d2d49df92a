"""A load generator for any OpenAI-compatible server (jaxserve's or vLLM's).

Every request streams (``stream: true`` with ``stream_options.include_usage``) and its
client-side timestamps are kept: send, every *content* chunk (an SSE event whose choice
carries non-empty text, chat delta content or token ids; role-only and usage-only
events are not content), and end (arrival of ``data: [DONE]``). "Send" is when the
request leaves the client, after any wait for a ``--max-concurrency`` slot, so client
side queueing is not counted; server-side queueing is.

A request fails on a non-200 status, an ``error`` event, a stream that ends without
``[DONE]``, a transport error or the timeout (whole request). The client only ever
connects to the base URL (proxy environment variables are ignored).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from jaxserve.bench.datasets import Prompt, arrival_times

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class RequestRecord:
    """What the client saw for one request; times are seconds since the run began."""
    prompt_len: int
    max_tokens: int
    send: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None   # from usage
    usage_completion_tokens: int | None = None
    text: str = ""
    success: bool = False
    error: str = ""


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    timeout: float = 600.0
    burstiness: float = 1.0
    extra_body: dict[str, Any] = field(default_factory=dict)   # more request fields


def build_payload(endpoint: str, model: str, p: Prompt, ignore_eos: bool, temperature: float,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": p.output_len, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True},
                            **(extra or {})}
    if endpoint == CHAT:
        if not isinstance(p.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, got token ids")
        body["messages"] = [{"role": "user", "content": p.prompt}]
    elif endpoint == COMPLETIONS:
        body["prompt"] = p.prompt
    else:
        raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}, got {endpoint!r}")
    if ignore_eos:
        body["ignore_eos"] = True   # vLLM-style extra field
    return body


def _content(event: dict[str, Any]) -> str | None:
    """The event's new text ("" for token ids without text); None: not a content event."""
    found = None
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
        if text or choice.get("token_ids"):
            found = (found or "") + (text or "")
    return found


def feed_line(rec: RequestRecord, line: str, now: float) -> bool:
    """Apply one SSE line to the record; True when it is ``data: [DONE]``."""
    if not line.startswith("data:"):
        return False   # blank separators, ": comments", other SSE fields
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if event.get("error"):
        raise RuntimeError(f"error event: {json.dumps(event['error'])[:300]}")
    text = _content(event)
    if text is not None:
        rec.chunk_times.append(now)
        rec.text += text
    usage = event.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.usage_completion_tokens = usage.get("completion_tokens")
    return False


async def send_request(client: httpx.AsyncClient, endpoint: str, payload: dict[str, Any],
                       rec: RequestRecord, timeout: float, clock: Callable[[], float]) -> None:
    rec.send = clock()
    done_at: float | None = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", endpoint, json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"HTTP {resp.status_code}: {body[:300]}")
                async for line in resp.aiter_lines():   # drain so the connection is reused
                    if done_at is None and feed_line(rec, line, clock()):
                        done_at = clock()
        if done_at is None:
            raise RuntimeError("stream ended without data: [DONE]")
    except TimeoutError:
        rec.error = f"timeout after {timeout} s"
    except Exception as e:   # one bad request must not end the run
        rec.error = f"{type(e).__name__}: {e}"
    if done_at is not None:   # complete, even if draining the tail failed
        rec.end, rec.success, rec.error = done_at, True, ""
    else:
        rec.end = clock()
    rec.output_tokens = (rec.usage_completion_tokens if rec.usage_completion_tokens is not None
                         else len(rec.chunk_times))


def make_client(cfg: BenchConfig, pool: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, http1=True, http2=False, trust_env=False,
        limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
        timeout=httpx.Timeout(cfg.timeout, pool=None))


async def first_model(cfg: BenchConfig) -> str:
    async with make_client(cfg, 1) as client:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{cfg.base_url}/v1/models lists no models")
    return models[0]["id"]


async def wait_ready(cfg: BenchConfig, timeout: float, poll: float = 1.0) -> None:
    """Until GET /health answers 200 (a server still loading answers 503), or raise."""
    deadline = time.monotonic() + timeout
    async with make_client(cfg, 1) as client:
        while True:
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{cfg.base_url}/health did not answer 200 within "
                                   f"{timeout} s")
            await asyncio.sleep(poll)


async def run_benchmark(cfg: BenchConfig, prompts: list[Prompt], rate: float,
                        on_done: Callable[[], None] | None = None) -> list[RequestRecord]:
    """Send every prompt once (arrivals at `rate`, see arrival_times); records in prompt
    order. on_done: called as each request ends (a progress bar)."""
    if cfg.model is None:
        cfg = replace(cfg, model=await first_model(cfg))
    payloads = [build_payload(cfg.endpoint, cfg.model, p, cfg.ignore_eos, cfg.temperature,
                              cfg.extra_body) for p in prompts]
    offsets = arrival_times(len(prompts), rate, cfg.seed, cfg.burstiness)
    slots = cfg.max_concurrency or max(1, len(prompts))
    gate = asyncio.Semaphore(slots)
    records = [RequestRecord(p.prompt_len, p.output_len) for p in prompts]
    async with make_client(cfg, slots) as client:
        t0 = time.perf_counter()   # after the client exists: building it takes ~30 ms

        def clock() -> float:
            return time.perf_counter() - t0

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, offsets[i] - clock()))
            async with gate:
                await send_request(client, cfg.endpoint, payloads[i], records[i], cfg.timeout,
                                   clock)
            if on_done is not None:
                on_done()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return records
