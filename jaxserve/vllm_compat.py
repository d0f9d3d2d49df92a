"""vLLM's settings that have no jaxserve knob: the values that are true of jaxserve (taken,
and said at start-up) and why any other is refused.

`vllm serve` has some three hundred flags; most tune parts jaxserve does not have (CUDA
graphs, NCCL, Ray, LoRA, multimodal encoders, KV transfer, ...). A vLLM command line must
still start jaxserve or stop it with a reason, never "unrecognized arguments": every flag
of vLLM's that is not an EngineConfig field or a server setting of jaxserve's is listed
here. ENGINE holds vLLM's engine arguments (flags of the server and the planner, and
`LLM(...)` keywords); FRONTEND the HTTP server's. Host only: no jax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

# Kinds of flag (how the command line spells a value): an on/off flag (--enable-x and
# --disable-x, or --x and --no-x), a flag that is on when given (store_true), one value
# read by int / float / str / JSON, several values, or a value that may be left out.
BOOL, SWITCH, INT, FLOAT, STR, JSON, LIST, OPTIONAL = (
    "bool", "switch", "int", "float", "str", "json", "list", "optional")


class _Any:
    """Every value is true of jaxserve (a tuning knob of a part jaxserve does not have)."""

    def __repr__(self) -> str:
        return "any value"


ANY = _Any()


@dataclass(frozen=True)
class Setting:
    kind: str
    # The values that are true of jaxserve: a tuple, ANY, or a test of the value.
    accepted: tuple[Any, ...] | _Any | Callable[[Any], bool]
    why: str
    short: tuple[str, ...] = ()   # vLLM's short spellings (-asc, -dpn, ...)
    sample: Any = None            # an accepted value, where `accepted` is a test

    def holds(self, value: Any) -> bool:
        if self.accepted is ANY:
            return True
        if callable(self.accepted):
            return bool(self.accepted(value))
        return any(_same(value, a) for a in self.accepted)

    @property
    def taken(self) -> Any:
        """A value jaxserve takes, for tests (None where it takes none)."""
        if self.accepted is ANY or callable(self.accepted) or not self.accepted:
            return self.sample
        return self.accepted[0]

    def accepted_text(self) -> str:
        if self.accepted is ANY or callable(self.accepted):
            return "any value" if self.accepted is ANY else f"e.g. {self.sample!r}"
        if not self.accepted:
            return "no value"
        return " or ".join("off" if a is False else "on" if a is True else
                           "unset" if a is None else repr(a) for a in self.accepted)


def _same(value: Any, accepted: Any) -> bool:
    """value == accepted, but a bool only equals a bool (0 is not "off")."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"not JSON: {text!r}") from None


def _guidance(value: Any) -> bool:
    """--structured-outputs-config: unset, or the backend jaxserve has (llguidance)."""
    return not value or (isinstance(value, dict) and set(value) <= {"backend"}
                         and value.get("backend") in ("auto", "guidance"))


# Reasons shared by many settings.
_CUDA = ("jaxserve picks its own kernels (XLA and its Pallas kernels; the choice is logged "
         "at start-up): vLLM's CUDA kernel backends have no meaning here")
_GRAPHS = "no CUDA graphs: XLA compiles one program per batch bucket at warmup"
_COMPILE = "XLA compiles every program; vLLM's torch.compile settings have no meaning here"
_MULTI = ("jaxserve runs one process per host, joined by jax.distributed: give "
          "--coordinator-address, --num-processes and --process-id")
_DP = ("data parallelism is -dp D replicas behind one front door in the same processes; "
       "there are no separate data-parallel ranks, ports or load balancers")
_CP = "no context parallelism: shard with --tensor-parallel-size (--mesh 1xM)"
_EP = "no expert-parallel load balancing, micro-batching or all-to-all kernels"
_TEXT = ("jaxserve takes images (not video or audio) with its own settings only: "
         "--limit-mm-per-prompt, --allowed-local-media-path, --mm-processor-kwargs, "
         "--language-model-only")
_LORA = "LoRA adapters are not implemented"
_OFFLOAD = "weights and KV pages stay in device memory; nothing is offloaded to the host"
_SLEEP = "sleep mode is not implemented"
_POOL = "jaxserve generates text; pooling (embedding, classification, scoring) is not implemented"
_TRACE = "not implemented: the metrics are /metrics' (Prometheus) and the stats log line"
_DISAGG = "disaggregated serving (KV / encoder-cache transfer, KV events) is not implemented"
_HASH = ("prefix-cache pages are keyed by Python's hash of their token ids in one process; "
         "there is no choice of hash")
_MAMBA = ("the hybrids' state is jaxserve's: the conv state in the model dtype, the delta "
          "rule in float32, prefix-cache snapshots at page boundaries")
_PLUGIN = "no plugins are loaded; jaxserve runs only its own code"
_REMOTE = "jaxserve runs only its own model code; checkpoint code is never run"
_LOADER = ("weights are read by jaxserve's safetensors loader (or a converted checkpoint); "
           "vLLM's loader options have no meaning here")
_NOT = "not implemented"

# vLLM's engine arguments (EngineArgs): flags of `jaxserve serve` and `jaxserve plan`, and
# LLM(...) keywords.
ENGINE: dict[str, Setting] = {
    # model
    "runner": Setting(STR, ("auto", "generate"), _POOL),
    "convert": Setting(STR, ("auto", "none"), _POOL),
    "tokenizer_mode": Setting(STR, ("auto", "hf"), "the tokenizer is the checkpoint's Hugging "
                              "Face fast tokenizer (AutoTokenizer): 'auto' or 'hf'"),
    "hf_config_path": Setting(STR, (None,), "the config is the model directory's config.json"),
    "allowed_media_domains": Setting(LIST, (None, []), _TEXT),
    "code_revision": Setting(STR, (None,), _REMOTE),
    "tokenizer_revision": Setting(STR, (None,), "the tokenizer is read at --revision "
                                  "(from --tokenizer's directory or repo when given)"),
    "quantization_config": Setting(JSON, (None, {}), "weight quantization is --quantization "
                                   "(fp8, int8) or the checkpoint's own quantization_config"),
    "allow_deprecated_quantization": Setting(BOOL, ANY, "none of jaxserve's weight formats "
                                             "(fp8, int8) is deprecated"),
    "enable_return_routed_experts": Setting(BOOL, (False,), _NOT),
    "return_sampling_mask": Setting(BOOL, (False,), _NOT),
    "logprobs_mode": Setting(STR, ("raw_logprobs",), "logprobs are the model's raw "
                             "log-softmax, before temperature, penalties and top-k/p"),
    "use_fp64_gumbel": Setting(BOOL, (False,), "sampling draws in float32 on device"),
    "enable_trace_replay": Setting(BOOL, (False,), _NOT),
    "disable_sliding_window": Setting(BOOL, (False,), "a model's sliding-window layers "
                                      "(Gemma 4) always keep their window"),
    "disable_cascade_attn": Setting(BOOL, (None, True), "jaxserve has no cascade attention"),
    "skip_tokenizer_init": Setting(BOOL, (False,), "the checkpoint's tokenizer is always "
                                   "loaded"),
    "enable_prompt_embeds": Setting(BOOL, (False,), "prompts are text or token ids; "
                                    "embeddings as input are not implemented"),
    "config_format": Setting(STR, ("auto", "hf"), "the checkpoint's Hugging Face "
                             "config.json"),
    "hf_token": Setting(OPTIONAL, (None, True), "the token is huggingface_hub's: the HF_TOKEN "
                        "environment variable or `hf auth login` (a token on the command "
                        "line would show in the process list)"),
    "hf_overrides": Setting(JSON, (None, {}), "the checkpoint's config.json is read as it is"),
    "model_class_overrides": Setting(JSON, (None, {}), _REMOTE),
    "pooler_config": Setting(JSON, (None, {}), _POOL),
    "enable_sleep_mode": Setting(BOOL, (None, False), _SLEEP),
    "sleep_mode_backend": Setting(STR, ANY, _SLEEP),
    "sleep_mode_offload_cudagraph": Setting(BOOL, ANY, _SLEEP),
    "sleep_preserve_parameter_names": Setting(LIST, ANY, _SLEEP),
    "enable_cumem_allocator": Setting(BOOL, (False,), "device memory is JAX's allocator's"),
    "enable_nccl_comm_suspend": Setting(BOOL, (False,), "no NCCL: XLA's collectives"),
    "model_impl": Setting(STR, ("auto",), _REMOTE),
    "logits_processors": Setting(LIST, (None, []), _PLUGIN),
    "io_processor_plugin": Setting(STR, (None,), _PLUGIN),
    "renderer_num_workers": Setting(INT, (1,), "chat templates are rendered in one worker "
                                    "thread"),
    # loading
    "safetensors_load_strategy": Setting(STR, (None,), _LOADER),
    "safetensors_prefetch_num_threads": Setting(INT, ANY, _LOADER),
    "safetensors_prefetch_block_size": Setting(STR, ANY, _LOADER),
    "model_loader_extra_config": Setting(JSON, (None, {}), _LOADER),
    "ignore_patterns": Setting(LIST, (["original/**/*"],), "only config, tokenizer and "
                               "safetensors files are downloaded"),
    "use_tqdm_on_load": Setting(BOOL, ANY, "loading progress is logged and shown on /health"),
    "pt_load_map_location": Setting(STR, ANY, "jaxserve reads safetensors only, never .pt "
                                    "files"),
    # kernels
    "mamba_backend": Setting(STR, ("triton",), _CUDA),
    "mamba_ssu_algorithm": Setting(STR, (None, "auto"), _CUDA),
    "enable_mamba_cache_stochastic_rounding": Setting(BOOL, (False,), _MAMBA),
    "mamba_cache_philox_rounds": Setting(INT, (0,), _MAMBA),
    "reasoning_parser_plugin": Setting(STR, ("",), _PLUGIN),
    "gdn_prefill_backend": Setting(STR, (None,), _CUDA),
    "kda_prefill_backend": Setting(STR, (None, "auto"), _CUDA),
    "kda_decode_backend": Setting(STR, (None, "auto"), _CUDA),
    "moe_backend": Setting(STR, ("auto",), _CUDA),
    "linear_backend": Setting(STR, ("auto",), _CUDA),
    "sparse_indexer_topk_backend": Setting(STR, ("auto",), _CUDA),
    "enable_flashinfer_autotune": Setting(BOOL, (None, False), _CUDA),
    "monokernel": Setting(BOOL, (False,), _CUDA),
    "ir_op_priority": Setting(JSON, (None, {}), _CUDA),
    "kernel_config": Setting(JSON, (None, {}), _CUDA),
    "attention_config": Setting(JSON, (None, {}), "the attention backend is "
                                "--attention-backend's", short=("-ac",)),
    # parallelism and processes
    "distributed_executor_backend": Setting(STR, (None, "mp", "uni"), _MULTI),
    "master_addr": Setting(STR, ("127.0.0.1",), _MULTI),
    "master_port": Setting(INT, (29501,), _MULTI),
    "nnodes": Setting(INT, (1,), _MULTI, short=("-n",)),
    "node_rank": Setting(INT, (0,), _MULTI, short=("-r",)),
    "distributed_timeout_seconds": Setting(INT, (None,), _MULTI),
    "cpu_distributed_timeout_seconds": Setting(INT, (None,), _MULTI),
    "numa_bind": Setting(BOOL, (False,), _NOT),
    "numa_bind_nodes": Setting(LIST, (None, []), _NOT),
    "numa_bind_cpus": Setting(LIST, (None, []), _NOT),
    "device_ids": Setting(STR, (None,), "JAX uses the visible devices: choose them with "
                          "CUDA_VISIBLE_DEVICES (GPU) or TPU_VISIBLE_CHIPS (TPU)"),
    "decode_context_parallel_size": Setting(INT, (1,), _CP, short=("-dcp",)),
    "dcp_comm_backend": Setting(STR, (None,), _CP),
    "dcp_q_replicate": Setting(BOOL, (None, False), _CP),
    "dcp_kv_cache_interleave_size": Setting(INT, (1,), _CP),
    "cp_kv_cache_interleave_size": Setting(INT, (None, 1), _CP),
    "prefill_context_parallel_size": Setting(INT, (1,), _CP, short=("-pcp",)),
    "data_parallel_rank": Setting(INT, (None,), _DP, short=("-dpn",)),
    "data_parallel_start_rank": Setting(INT, (None,), _DP, short=("-dpr",)),
    "data_parallel_size_local": Setting(INT, (None,), _DP, short=("-dpl",)),
    "data_parallel_address": Setting(STR, (None,), _DP, short=("-dpa",)),
    "data_parallel_rpc_port": Setting(INT, (None,), _DP, short=("-dpp",)),
    "data_parallel_backend": Setting(STR, ("mp",), _DP, short=("-dpb",)),
    "data_parallel_hybrid_lb": Setting(BOOL, (False,), _DP, short=("-dph",)),
    "data_parallel_external_lb": Setting(BOOL, (False,), _DP, short=("-dpe",)),
    "data_parallel_multi_port_external_lb": Setting(SWITCH, (False,), _DP, short=("-dpm",)),
    "enable_hc_sp": Setting(BOOL, (False,), _NOT),
    "enable_batch_sharded_sampling": Setting(BOOL, (None, False), "every device samples "
                                             "the whole batch (the logits are gathered "
                                             "over the vocabulary)"),
    "enable_ep_weight_filter": Setting(BOOL, (False,), _EP),
    "all2all_backend": Setting(STR, ("allgather_reducescatter",), _EP),
    "enable_dbo": Setting(BOOL, (False,), _EP),
    "enable_shm_tensor_arena": Setting(BOOL, (False,), _NOT),
    "ubatch_size": Setting(INT, (0,), _EP),
    "enable_elastic_ep": Setting(BOOL, (False,), _EP),
    "elastic_ep_max_dp_size": Setting(INT, (None,), _EP),
    "dbo_decode_token_threshold": Setting(INT, ANY, _EP),
    "dbo_prefill_token_threshold": Setting(INT, ANY, _EP),
    "dp_sync_interval": Setting(INT, ANY, _DP),
    "disable_nccl_for_dp_synchronization": Setting(BOOL, ANY, "no NCCL: XLA's collectives"),
    "enable_eplb": Setting(BOOL, (False,), _EP),
    "eplb_config": Setting(JSON, ANY, _EP),
    "expert_placement_strategy": Setting(STR, ("linear",), "experts are split in contiguous "
                                         "blocks"),
    "max_parallel_loading_workers": Setting(INT, (None,), _LOADER),
    "ray_workers_use_nsight": Setting(BOOL, (False,), _MULTI),
    "disable_custom_all_reduce": Setting(BOOL, (True,), "no custom all-reduce: XLA's "
                                         "collectives"),
    "worker_cls": Setting(STR, ("auto",), _PLUGIN),
    "worker_extension_cls": Setting(STR, ("",), _PLUGIN),
    "enable_fault_tolerance": Setting(BOOL, (False,), _NOT),
    "fault_tolerance_config": Setting(JSON, ANY, _NOT),
    # cache
    "prefix_caching_hash_algo": Setting(STR, (), _HASH),
    "prefix_cache_retention_interval": Setting(FLOAT, (None, 0), "cached pages are evicted "
                                               "only when pages are needed (LRU)"),
    "kv_cache_dtype_skip_layers": Setting(LIST, (None, []), "--kv-cache-dtype applies to "
                                          "every layer"),
    "kv_sharing_fast_prefill": Setting(BOOL, (False,), _NOT),
    "swa_bounded_replay": Setting(BOOL, ANY, "a DeepSeek-V4.1 setting; jaxserve has no such "
                                  "model"),
    "mamba_cache_dtype": Setting(STR, ("auto",), _MAMBA),
    "mamba_ssm_cache_dtype": Setting(STR, ("auto",), _MAMBA),
    "mamba_block_size": Setting(INT, (None,), _MAMBA),
    "prefix_match_unit": Setting(INT, (None,), _MAMBA),
    "mamba_cache_mode": Setting(STR, (None,), _MAMBA),
    "enable_mamba_shared_prefix_checkpoint": Setting(BOOL, (False,), _MAMBA),
    "replayssm_buffer_len": Setting(INT, ANY, _MAMBA),
    "use_replayssm": Setting(BOOL, (False,), _MAMBA),
    "kv_offloading_size": Setting(FLOAT, (None, 0), _OFFLOAD),
    "kv_offloading_backend": Setting(STR, ANY, _OFFLOAD),
    "offload_backend": Setting(STR, ANY, _OFFLOAD),
    "cpu_offload_gb": Setting(FLOAT, (0,), _OFFLOAD),
    "cpu_offload_params": Setting(LIST, (None, [], set()), _OFFLOAD),
    "offload_group_size": Setting(INT, (0,), _OFFLOAD),
    "offload_num_in_group": Setting(INT, ANY, _OFFLOAD),
    "offload_prefetch_step": Setting(INT, ANY, _OFFLOAD),
    "offload_params": Setting(LIST, (None, [], set()), _OFFLOAD),
    # multimodal
    "enable_mm_embeds": Setting(BOOL, (False,), _TEXT),
    "media_io_kwargs": Setting(JSON, (None, {}), "images are decoded by PIL with jaxserve's "
                               "own limits (docs/VISION.md); no media loader options"),
    "mm_processor_cache_gb": Setting(FLOAT, ANY, _TEXT),
    "mm_processor_cache_type": Setting(STR, ANY, _TEXT),
    "mm_hasher_algorithm": Setting(STR, ANY, _TEXT),
    "mm_shm_cache_max_object_size_mb": Setting(INT, ANY, _TEXT),
    "mm_encoder_only": Setting(BOOL, (False,), _TEXT),
    "mm_encoder_tp_mode": Setting(STR, ANY, _TEXT),
    "mm_encoder_attn_backend": Setting(STR, ANY, _TEXT),
    "mm_encoder_attn_dtype": Setting(STR, ANY, _TEXT),
    "mm_encoder_fp8_scale_path": Setting(STR, ANY, _TEXT),
    "mm_encoder_fp8_scale_save_path": Setting(STR, (None,), _TEXT),
    "mm_encoder_fp8_scale_save_margin": Setting(FLOAT, ANY, _TEXT),
    "interleave_mm_strings": Setting(BOOL, ANY, _TEXT),
    "skip_mm_profiling": Setting(BOOL, ANY, _TEXT),
    "video_pruning_rate": Setting(FLOAT, ANY, _TEXT),
    "video_pruning_method": Setting(STR, ANY, _TEXT),
    "mm_tensor_ipc": Setting(STR, ANY, _TEXT),
    "mm_processor_device": Setting(STR, ANY, _TEXT),
    "mm_ipc_gpu_memory_gb": Setting(FLOAT, ANY, _TEXT),
    "mm_device_do_normalize": Setting(BOOL, ANY, _TEXT),
    "disable_chunked_mm_input": Setting(BOOL, ANY, _TEXT),
    # LoRA
    "enable_lora": Setting(BOOL, (None, False), _LORA),
    "max_loras": Setting(INT, ANY, _LORA),
    "max_lora_rank": Setting(INT, ANY, _LORA),
    "lora_dtype": Setting(STR, ANY, _LORA),
    "enable_tower_connector_lora": Setting(BOOL, (False,), _LORA),
    "max_cpu_loras": Setting(INT, ANY, _LORA),
    "fully_sharded_loras": Setting(BOOL, ANY, _LORA),
    "lora_target_modules": Setting(LIST, ANY, _LORA),
    "default_mm_loras": Setting(JSON, (None, {}), _LORA),
    "specialize_active_lora": Setting(BOOL, ANY, _LORA),
    "enable_mixed_moe_lora_format": Setting(BOOL, ANY, _LORA),
    "enable_moe_shared_loras": Setting(BOOL, ANY, _LORA),
    "max_lora_cls_labels": Setting(INT, ANY, _LORA),
    # observability
    "logging_config": Setting(JSON, (None, {}), "jaxserve logs through Python's logging "
                              "(logger 'jaxserve'); set the level with --log-level"),
    "log_config_file": Setting(STR, (None,), "jaxserve logs through Python's logging "
                               "(logger 'jaxserve'); set the level with --log-level"),
    "show_hidden_metrics_for_version": Setting(STR, (None,), _TRACE),
    "otlp_traces_endpoint": Setting(STR, (None,), _TRACE),
    "collect_detailed_traces": Setting(LIST, (None, []), _TRACE),
    "per_request_spec_decode_metrics": Setting(STR, ("none",), _TRACE),
    "kv_cache_metrics": Setting(BOOL, (False,), _TRACE),
    "kv_cache_metrics_sample": Setting(FLOAT, ANY, _TRACE),
    "custom_histogram_buckets": Setting(JSON, (None,), _TRACE),
    "cudagraph_metrics": Setting(BOOL, (False,), _GRAPHS),
    "enable_layerwise_nvtx_tracing": Setting(BOOL, (False,), _TRACE),
    "enable_mfu_metrics": Setting(BOOL, (False,), _TRACE),
    "enable_logging_iteration_details": Setting(BOOL, (False,), _TRACE),
    "profiler_config": Setting(JSON, (None, {}), _TRACE),
    "jit_monitor_mode": Setting(STR, ANY, "jaxserve compiles every program at warmup and "
                                "counts compilations (logged, /metrics); none happens after"),
    "jit_monitor_verbose": Setting(BOOL, ANY, "see --jit-monitor-mode"),
    "aggregate_engine_logging": Setting(SWITCH, (False,), "one stats line per server"),
    "fail_on_environ_validation": Setting(BOOL, ANY, "jaxserve reads no VLLM_* environment "
                                          "variables"),
    # scheduler
    "max_num_scheduled_tokens": Setting(INT, (None,), "a step's tokens are "
                                        "--max-num-batched-tokens, drafts included"),
    "max_num_active_seqs": Setting(INT, (None,), "--max-num-seqs is both the runner's rows "
                                   "and the running requests"),
    "max_num_queued_reqs": Setting(INT, (None,), "jaxserve's bound on waiting work is "
                                   "--max-waiting-requests (sequences; 503 beyond it)"),
    "max_num_queued_tokens": Setting(INT, (None,), "jaxserve's bound on waiting work is "
                                     "--max-waiting-requests (sequences; 503 beyond it)"),
    "long_prefill_token_threshold": Setting(INT, (0,), "a prompt's chunk is as long as the "
                                            "step's budget lets it be"),
    "long_prefill_token_threshold_adaptive": Setting(BOOL, (False,), "a prompt's chunk is "
                                                     "as long as the step's budget lets it be"),
    "scheduler_cls": Setting(STR, (None,), _PLUGIN),
    "scheduler_reserve_full_isl": Setting(BOOL, (False,), "a request is admitted when its "
                                          "first chunk's pages fit; it is preempted (and "
                                          "recomputed) if pages run out later"),
    "watermark": Setting(FLOAT, (0, 0.0), "waiting requests are admitted while pages are "
                         "free (no watermark)"),
    "prefill_schedule_interval": Setting(INT, (1,), "prompts are admitted at every step"),
    "disable_hybrid_kv_cache_manager": Setting(BOOL, (None, False), "jaxserve's one cache "
                                               "manager keeps every layer type's pages and "
                                               "state slots"),
    "stream_interval": Setting(INT, (1,), "a stream sends each step's tokens as they come"),
    "cudagraph_capture_sizes": Setting(LIST, (None, []), _GRAPHS),
    "max_cudagraph_capture_size": Setting(INT, (None,), _GRAPHS),
    # configs of parts jaxserve does not have
    "watermark_config": Setting(JSON, (None, {}), "output watermarking is not implemented"),
    "diffusion_config": Setting(JSON, (None, {}), "diffusion language models are not "
                                "implemented", short=("-dc",)),
    "kv_transfer_config": Setting(JSON, (None, {}), _DISAGG),
    "kv_events_config": Setting(JSON, (None, {}), _DISAGG),
    "ec_transfer_config": Setting(JSON, (None, {}), _DISAGG),
    "ec_manager_config": Setting(JSON, ANY, _DISAGG),
    "compilation_config": Setting(JSON, (None, {}), _COMPILE + "; see --enforce-eager",
                                  short=("-cc",)),
    "optimization_level": Setting(STR, ("2", "O2", 2), _COMPILE),
    "performance_mode": Setting(STR, ("balanced",), _NOT),
    "engram_config": Setting(JSON, (None, {}), _NOT),
    "reasoning_config": Setting(JSON, (None, {}), "reasoning output is split by "
                                "--reasoning-parser"),
    "additional_config": Setting(JSON, (None, {}), _PLUGIN),
    "structured_outputs_config": Setting(JSON, _guidance, "structured outputs use "
                                         "llguidance: backend 'auto' or 'guidance'",
                                         sample={"backend": "guidance"}),
    "aux_output_config": Setting(JSON, (None, {}), _NOT),
    "watchdog_config": Setting(JSON, ANY, "a failed engine step stops the server (exit 1) "
                               "for a supervisor to restart it"),
    "weight_transfer_config": Setting(JSON, (None, {}), _NOT),
    # vLLM flags from before its current --help that vLLM users still type
    "max_num_partial_prefills": Setting(INT, (), "jaxserve (as vLLM V1) has no limit of "
                                        "prompts in prefill: their chunks share each step's "
                                        "--max-num-batched-tokens in queue order"),
    "max_long_partial_prefills": Setting(INT, (), "jaxserve (as vLLM V1) has no limit of "
                                         "prompts in prefill: their chunks share each step's "
                                         "--max-num-batched-tokens in queue order"),
    "task": Setting(STR, ("auto", "generate"), _POOL),
    "device": Setting(STR, ("auto",), "JAX picks the platform (JAX_PLATFORMS chooses one)"),
    "num_scheduler_steps": Setting(INT, (1,), "one scheduling pass per step"),
    "tokenizer_pool_size": Setting(INT, (0,), "prompts are tokenized in the server's worker "
                                   "thread"),
    "guided_decoding_backend": Setting(STR, ("auto", "guidance"), "structured outputs use "
                                       "llguidance"),
}

# vLLM's HTTP server flags (FrontendArgs and vllm serve's own) that jaxserve has no
# setting for: `jaxserve serve` only.
FRONTEND: dict[str, Setting] = {
    "headless": Setting(SWITCH, (False,), _MULTI + "; hosts other than process 0 serve no "
                        "HTTP already"),
    "api_server_count": Setting(INT, (None, 1), "one HTTP server per engine (the engine "
                                "runs in its own thread)", short=("-asc",)),
    "grpc": Setting(SWITCH, (False,), "no gRPC server: the OpenAI-compatible HTTP API only"),
    "grpc_port": Setting(INT, (None,), "no gRPC server: the OpenAI-compatible HTTP API only"),
    "lora_modules": Setting(LIST, (None, []), _LORA),
    "chat_template_content_format": Setting(STR, ("string",), "message content is given to "
                                            "the chat template as a string (text parts "
                                            "joined)"),
    "trust_request_chat_template": Setting(BOOL, (False,), "a chat template in a request is "
                                           "refused (400); the server's is used"),
    "trust_request_mm_kwargs": Setting(BOOL, (False,), _TEXT),
    "reasoning_effort_map": Setting(JSON, (None, {}), "a request's reasoning_effort is "
                                    "refused by name; use chat_template_kwargs"),
    "response_role": Setting(STR, ("assistant",), "the answer's role is 'assistant'"),
    "return_tokens_as_token_ids": Setting(BOOL, (False,), _NOT),
    "exclude_tools_when_tool_choice_none": Setting(BOOL, (False,), "with tool_choice 'none' "
                                                   "the tools still reach the chat template"),
    "tool_parser_plugin": Setting(STR, ("",), _PLUGIN),
    "tool_strict_level": Setting(STR, (None,), _NOT),
    "tool_server": Setting(STR, (None,), "no built-in tool servers"),
    "enable_prompt_tokens_details": Setting(BOOL, (False,), _NOT),
    "enable_per_request_metrics": Setting(BOOL, (False,), _NOT),
    "enable_server_load_tracking": Setting(BOOL, ANY, "the load is always tracked: GET /load"),
    "enable_force_include_usage": Setting(BOOL, (False,), "a stream carries usage when "
                                          "stream_options.include_usage asks for it"),
    "sse_keep_alive_interval": Setting(INT, (0,), _NOT),
    "enable_log_outputs": Setting(BOOL, (False,), _NOT),
    "enable_log_deltas": Setting(BOOL, ANY, "only with --enable-log-outputs"),
    "cohere_is_reasoning_model": Setting(BOOL, ANY, "jaxserve has no Cohere API"),
    "cohere_format": Setting(STR, ANY, "jaxserve has no Cohere API"),
    "anthropic_disabled_thinking_effort": Setting(STR, ANY, "jaxserve has no Anthropic "
                                                  "Messages API"),
    "log_error_stack": Setting(BOOL, (False,), _NOT),
    "tokens_only": Setting(BOOL, (False,), _NOT),
    "enable_scale_out": Setting(BOOL, (False,), _NOT),
    "fingerprint_mode": Setting(STR, ("none",), "answers carry no system_fingerprint"),
    "fingerprint_value": Setting(STR, (None,), "answers carry no system_fingerprint"),
    "data_parallel_supervisor_port": Setting(INT, (9256,), _DP),
    "dp_supervisor_probe_interval_s": Setting(FLOAT, (5.0,), _DP),
    "dp_supervisor_probe_timeout_s": Setting(FLOAT, (5.0,), _DP),
    "dp_supervisor_probe_failure_threshold": Setting(INT, (3,), _DP),
    "disable_access_log_for_endpoints": Setting(STR, (None,), "not implemented; "
                                                "--disable-uvicorn-access-log turns the whole "
                                                "access log off"),
    "enable_ssl_refresh": Setting(BOOL, (False,), _NOT),
    "middleware": Setting(LIST, (None, []), _PLUGIN),
    "enable_request_id_headers": Setting(BOOL, (False,), _NOT),
    "h11_max_header_count": Setting(INT, (256,), _NOT),
    "enable_offline_docs": Setting(BOOL, (False,), _NOT),
    "enable_flash_late_interaction": Setting(BOOL, ANY, _POOL),
}
