"""EngineCore: loads the model, then runs schedule -> execute -> update, step by step."""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import replace

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.runner import compile_counter
from jaxserve.runner.kv_budget import choose_num_pages, page_bytes
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sampler import MAX_BANNED_TOKENS
from jaxserve.sampling_params import SamplingParams
from models.config import ModelConfig
from models.registry import build_model
from models.weights import load_params, param_bytes

logger = logging.getLogger("jaxserve")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str, checkpoint_dtype: str | None):
    if name == "auto":
        name = checkpoint_dtype if checkpoint_dtype in _DTYPES else "float32"
    return _DTYPES[name]


def enable_compilation_cache(path: str | None) -> None:
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class EngineCore:
    def __init__(self, config: EngineConfig, *, stream_outputs: bool = False):
        self.config = config
        enable_compilation_cache(config.compilation_cache_dir)
        if config.load_format != "dummy" and not os.path.isdir(config.model):
            raise ValueError(f"model path {config.model!r} does not exist or is not a directory")
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        self.tokenizer = _load_tokenizer(config.tokenizer or config.model)
        self.dtype = resolve_dtype(config.dtype, mc.dtype)
        kv_dtype = resolve_dtype(config.kv_cache_dtype, None) if config.kv_cache_dtype != "auto" \
            else self.dtype
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{mc.max_position_embeddings}")
        self.max_model_len = max_model_len
        if config.mesh is not None and config.mesh != "1x1":
            logger.warning("mesh=%s is parsed but not applied yet: running on one device "
                           "(tensor/data parallelism is issue 5)", config.mesh)
        self.eos_token_id = _eos_token_id(self.tokenizer, mc)

        t0 = time.perf_counter()
        self.model = build_model(mc, dtype=self.dtype, attention_backend=config.attention_backend)
        self.params = load_params(config.model, mc, self.model, self.dtype,
                                  load_format=config.load_format, seed=config.seed)
        self.weight_bytes = param_bytes(self.params)
        logger.info("loaded %s (%s, %s) in %.1f s: %.2f GiB of weights", config.model,
                    mc.architecture, jnp.dtype(self.dtype).name, time.perf_counter() - t0,
                    self.weight_bytes / 2**30)

        per_page = page_bytes(num_layers=mc.num_layers, page_size=config.page_size,
                              num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                              itemsize=jnp.dtype(kv_dtype).itemsize)
        self.num_pages = choose_num_pages(
            num_pages=config.num_pages, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            hbm_utilization=config.hbm_utilization, bytes_per_page=per_page,
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            page_size=config.page_size, device=jax.devices()[0])
        kv_tokens = (self.num_pages - 1) * config.page_size
        logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB); max concurrency at "
                    "%d tokens: %.1fx", self.num_pages - 1, config.page_size, kv_tokens,
                    self.num_pages * per_page / 2**30, max_model_len, kv_tokens / max_model_len)

        self.runner = ModelRunner(
            model=self.model, params=self.params, num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size,
            num_pages=self.num_pages, page_size=config.page_size,
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=config.num_batched_tokens, kv_dtype=kv_dtype,
            eos_token_id=self.eos_token_id)
        self.runner.warmup()
        self.scheduler = Scheduler(
            num_pages=self.num_pages, page_size=config.page_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=config.enable_prefix_caching,
            policy=config.scheduling_policy)
        self.outputs = OutputProcessor(self.tokenizer, stream=stream_outputs)
        self.num_steps = 0
        self.num_scheduled_tokens = 0   # tokens computed on device, all steps
        # Seeds for requests that bring none: reproducible from the engine seed.
        self._seed_counter = itertools.count(config.seed * 1_000_003 + 1)

    # ---- requests ------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Checks one request; returns its params with max_tokens resolved."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; max_model_len={self.max_model_len} "
                             f"leaves no room to generate (prompt must be < max_model_len)")
        if params.min_tokens and len(params.stop_token_ids) + 1 > MAX_BANNED_TOKENS:
            raise ValueError(f"stop_token_ids: at most {MAX_BANNED_TOKENS - 1} with min_tokens "
                             f"> 0, got {len(params.stop_token_ids)}")
        room = self.max_model_len - n
        if params.max_tokens is None:
            params = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        elif params.max_tokens > room:
            raise ValueError(f"max_tokens={params.max_tokens} cannot fit: the prompt has {n} "
                             f"tokens and max_model_len={self.max_model_len} leaves {room}")
        return params

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, prompt: str | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        if self.outputs.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self.validate(prompt_token_ids, params)
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}"
                                                        for i in range(params.n)]
        self.outputs.add(request_id, prompt, list(prompt_token_ids), params, child_ids)
        # A request-private salt keeps the prefix cache among the request's own n
        # completions: when caching is off, and when prompt logprobs are wanted (a
        # cached position would not be computed, so it would have no logprob).
        private = (params.prompt_logprobs is not None
                   or (not self.config.enable_prefix_caching and params.n > 1))
        salt = request_id if private else None
        for i, cid in enumerate(child_ids):
            child = params if params.n == 1 else params.child(i)
            if child.seed is None:
                child = replace(child, seed=next(self._seed_counter))
            self.scheduler.add_request(Request(
                cid, prompt_token_ids, child, eos_token_id=self.eos_token_id,
                arrival_time=arrival_time, priority=priority, cache_salt=salt,
                page_size=self.config.page_size))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        children = self.outputs.child_ids(request_id)
        self.scheduler.abort_requests(children)
        return self.outputs.abort(request_id)

    # ---- the loop ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        self.num_steps += 1
        self.num_scheduled_tokens += sched_out.num_scheduled_tokens
        runner_out = self.runner.execute(sched_out)
        updated = self.scheduler.update_from_output(sched_out, runner_out.sampled)
        outs, stopped = self.outputs.process(updated, runner_out)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outs

    @property
    def num_compilations(self) -> int:
        return compile_counter.num_compilations()


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer at %s (%s): prompts must be token ids and outputs "
                       "carry no text", path, e)
        return None


def _eos_token_id(tokenizer, mc: ModelConfig) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = mc.eos_token_id
    return eos[0] if isinstance(eos, (list, tuple)) else eos
