"""vLLM's engine arguments (EngineArgs) without a jaxserve knob: flags of `jaxserve
serve` and `jaxserve plan`, and `LLM(...)` keywords (the table's rules: vllm_compat.py)."""
from __future__ import annotations

from jaxserve.config.vllm_settings import (ANY, BOOL, FLOAT, INT, JSON, LIST, OPTIONAL, STR,
                                           SWITCH, Setting, WHY_COMPILE, WHY_CP, WHY_CUDA,
                                           WHY_DISAGG, WHY_DP, WHY_EP, WHY_GRAPHS, WHY_HASH,
                                           WHY_LOADER, WHY_LORA, WHY_MAMBA, WHY_MULTI, WHY_NOT,
                                           WHY_OFFLOAD, WHY_PLUGIN, WHY_POOL, WHY_REMOTE,
                                           WHY_SLEEP, WHY_TEXT, WHY_TRACE, guidance_backend)

# vLLM's engine arguments (EngineArgs): flags of `jaxserve serve` and `jaxserve plan`, and
# LLM(...) keywords.
ENGINE: dict[str, Setting] = {
    # model
    "runner": Setting(STR, ("auto", "generate"), WHY_POOL),
    "convert": Setting(STR, ("auto", "none"), WHY_POOL),
    "tokenizer_mode": Setting(STR, ("auto", "hf"), "the tokenizer is the checkpoint's Hugging "
                              "Face fast tokenizer (AutoTokenizer): 'auto' or 'hf'"),
    "hf_config_path": Setting(STR, (None,), "the config is the model directory's config.json"),
    "allowed_media_domains": Setting(LIST, (None, []), WHY_TEXT),
    "code_revision": Setting(STR, (None,), WHY_REMOTE),
    "tokenizer_revision": Setting(STR, (None,), "the tokenizer is read at --revision "
                                  "(from --tokenizer's directory or repo when given)"),
    "quantization_config": Setting(JSON, (None, {}), "weight quantization is --quantization "
                                   "(fp8, int8) or the checkpoint's own quantization_config"),
    "allow_deprecated_quantization": Setting(BOOL, ANY, "none of jaxserve's weight formats "
                                             "(fp8, int8) is deprecated"),
    "enable_return_routed_experts": Setting(BOOL, (False,), WHY_NOT),
    "return_sampling_mask": Setting(BOOL, (False,), WHY_NOT),
    "logprobs_mode": Setting(STR, ("raw_logprobs",), "logprobs are the model's raw "
                             "log-softmax, before temperature, penalties and top-k/p"),
    "use_fp64_gumbel": Setting(BOOL, (False,), "sampling draws in float32 on device"),
    "enable_trace_replay": Setting(BOOL, (False,), WHY_NOT),
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
    "model_class_overrides": Setting(JSON, (None, {}), WHY_REMOTE),
    "pooler_config": Setting(JSON, (None, {}), WHY_POOL),
    "enable_sleep_mode": Setting(BOOL, (None, False), WHY_SLEEP),
    "sleep_mode_backend": Setting(STR, ANY, WHY_SLEEP),
    "sleep_mode_offload_cudagraph": Setting(BOOL, ANY, WHY_SLEEP),
    "sleep_preserve_parameter_names": Setting(LIST, ANY, WHY_SLEEP),
    "enable_cumem_allocator": Setting(BOOL, (False,), "device memory is JAX's allocator's"),
    "enable_nccl_comm_suspend": Setting(BOOL, (False,), "no NCCL: XLA's collectives"),
    "model_impl": Setting(STR, ("auto",), WHY_REMOTE),
    "logits_processors": Setting(LIST, (None, []), WHY_PLUGIN),
    "io_processor_plugin": Setting(STR, (None,), WHY_PLUGIN),
    "renderer_num_workers": Setting(INT, (1,), "chat templates are rendered in one worker "
                                    "thread"),
    # loading
    "safetensors_load_strategy": Setting(STR, (None,), WHY_LOADER),
    "safetensors_prefetch_num_threads": Setting(INT, ANY, WHY_LOADER),
    "safetensors_prefetch_block_size": Setting(STR, ANY, WHY_LOADER),
    "model_loader_extra_config": Setting(JSON, (None, {}), WHY_LOADER),
    "ignore_patterns": Setting(LIST, (["original/**/*"],), "only config, tokenizer and "
                               "safetensors files are downloaded"),
    "use_tqdm_on_load": Setting(BOOL, ANY, "loading progress is logged and shown on /health"),
    "pt_load_map_location": Setting(STR, ANY, "jaxserve reads safetensors only, never .pt "
                                    "files"),
    # kernels
    "mamba_backend": Setting(STR, ("triton",), WHY_CUDA),
    "mamba_ssu_algorithm": Setting(STR, (None, "auto"), WHY_CUDA),
    "enable_mamba_cache_stochastic_rounding": Setting(BOOL, (False,), WHY_MAMBA),
    "mamba_cache_philox_rounds": Setting(INT, (0,), WHY_MAMBA),
    "reasoning_parser_plugin": Setting(STR, ("",), WHY_PLUGIN),
    "gdn_prefill_backend": Setting(STR, (None,), WHY_CUDA),
    "kda_prefill_backend": Setting(STR, (None, "auto"), WHY_CUDA),
    "kda_decode_backend": Setting(STR, (None, "auto"), WHY_CUDA),
    "moe_backend": Setting(STR, ("auto",), WHY_CUDA),
    "linear_backend": Setting(STR, ("auto",), WHY_CUDA),
    "sparse_indexer_topk_backend": Setting(STR, ("auto",), WHY_CUDA),
    "enable_flashinfer_autotune": Setting(BOOL, (None, False), WHY_CUDA),
    "monokernel": Setting(BOOL, (False,), WHY_CUDA),
    "ir_op_priority": Setting(JSON, (None, {}), WHY_CUDA),
    "kernel_config": Setting(JSON, (None, {}), WHY_CUDA),
    "attention_config": Setting(JSON, (None, {}), "the attention backend is "
                                "--attention-backend's", short=("-ac",)),
    # parallelism and processes
    "distributed_executor_backend": Setting(STR, (None, "mp", "uni"), WHY_MULTI),
    "master_addr": Setting(STR, ("127.0.0.1",), WHY_MULTI),
    "master_port": Setting(INT, (29501,), WHY_MULTI),
    "nnodes": Setting(INT, (1,), WHY_MULTI, short=("-n",)),
    "node_rank": Setting(INT, (0,), WHY_MULTI, short=("-r",)),
    "distributed_timeout_seconds": Setting(INT, (None,), WHY_MULTI),
    "cpu_distributed_timeout_seconds": Setting(INT, (None,), WHY_MULTI),
    "numa_bind": Setting(BOOL, (False,), WHY_NOT),
    "numa_bind_nodes": Setting(LIST, (None, []), WHY_NOT),
    "numa_bind_cpus": Setting(LIST, (None, []), WHY_NOT),
    "device_ids": Setting(STR, (None,), "JAX uses the visible devices: choose them with "
                          "CUDA_VISIBLE_DEVICES (GPU) or TPU_VISIBLE_CHIPS (TPU)"),
    "decode_context_parallel_size": Setting(INT, (1,), WHY_CP, short=("-dcp",)),
    "dcp_comm_backend": Setting(STR, (None,), WHY_CP),
    "dcp_q_replicate": Setting(BOOL, (None, False), WHY_CP),
    "dcp_kv_cache_interleave_size": Setting(INT, (1,), WHY_CP),
    "cp_kv_cache_interleave_size": Setting(INT, (None, 1), WHY_CP),
    "prefill_context_parallel_size": Setting(INT, (1,), WHY_CP, short=("-pcp",)),
    "data_parallel_rank": Setting(INT, (None,), WHY_DP, short=("-dpn",)),
    "data_parallel_start_rank": Setting(INT, (None,), WHY_DP, short=("-dpr",)),
    "data_parallel_size_local": Setting(INT, (None,), WHY_DP, short=("-dpl",)),
    "data_parallel_address": Setting(STR, (None,), WHY_DP, short=("-dpa",)),
    "data_parallel_rpc_port": Setting(INT, (None,), WHY_DP, short=("-dpp",)),
    "data_parallel_backend": Setting(STR, ("mp",), WHY_DP, short=("-dpb",)),
    "data_parallel_hybrid_lb": Setting(BOOL, (False,), WHY_DP, short=("-dph",)),
    "data_parallel_external_lb": Setting(BOOL, (False,), WHY_DP, short=("-dpe",)),
    "data_parallel_multi_port_external_lb": Setting(SWITCH, (False,), WHY_DP, short=("-dpm",)),
    "enable_hc_sp": Setting(BOOL, (False,), WHY_NOT),
    "enable_batch_sharded_sampling": Setting(BOOL, (None, False), "every device samples "
                                             "the whole batch (the logits are gathered "
                                             "over the vocabulary)"),
    "enable_ep_weight_filter": Setting(BOOL, (False,), WHY_EP),
    "all2all_backend": Setting(STR, ("allgather_reducescatter",), WHY_EP),
    "enable_dbo": Setting(BOOL, (False,), WHY_EP),
    "enable_shm_tensor_arena": Setting(BOOL, (False,), WHY_NOT),
    "ubatch_size": Setting(INT, (0,), WHY_EP),
    "enable_elastic_ep": Setting(BOOL, (False,), WHY_EP),
    "elastic_ep_max_dp_size": Setting(INT, (None,), WHY_EP),
    "dbo_decode_token_threshold": Setting(INT, ANY, WHY_EP),
    "dbo_prefill_token_threshold": Setting(INT, ANY, WHY_EP),
    "dp_sync_interval": Setting(INT, ANY, WHY_DP),
    "disable_nccl_for_dp_synchronization": Setting(BOOL, ANY, "no NCCL: XLA's collectives"),
    "enable_eplb": Setting(BOOL, (False,), WHY_EP),
    "eplb_config": Setting(JSON, ANY, WHY_EP),
    "expert_placement_strategy": Setting(STR, ("linear",), "experts are split in contiguous "
                                         "blocks"),
    "max_parallel_loading_workers": Setting(INT, (None,), WHY_LOADER),
    "ray_workers_use_nsight": Setting(BOOL, (False,), WHY_MULTI),
    "disable_custom_all_reduce": Setting(BOOL, (True,), "no custom all-reduce: XLA's "
                                         "collectives"),
    "worker_cls": Setting(STR, ("auto",), WHY_PLUGIN),
    "worker_extension_cls": Setting(STR, ("",), WHY_PLUGIN),
    "enable_fault_tolerance": Setting(BOOL, (False,), WHY_NOT),
    "fault_tolerance_config": Setting(JSON, ANY, WHY_NOT),
    # cache
    "prefix_caching_hash_algo": Setting(STR, (), WHY_HASH),
    "prefix_cache_retention_interval": Setting(FLOAT, (None, 0), "cached pages are evicted "
                                               "only when pages are needed (LRU)"),
    "kv_cache_dtype_skip_layers": Setting(LIST, (None, []), "--kv-cache-dtype applies to "
                                          "every layer"),
    "kv_sharing_fast_prefill": Setting(BOOL, (False,), WHY_NOT),
    "swa_bounded_replay": Setting(BOOL, ANY, "a DeepSeek-V4.1 setting; jaxserve has no such "
                                  "model"),
    "mamba_cache_dtype": Setting(STR, ("auto",), WHY_MAMBA),
    "mamba_ssm_cache_dtype": Setting(STR, ("auto",), WHY_MAMBA),
    "mamba_block_size": Setting(INT, (None,), WHY_MAMBA),
    "prefix_match_unit": Setting(INT, (None,), WHY_MAMBA),
    "mamba_cache_mode": Setting(STR, (None,), WHY_MAMBA),
    "enable_mamba_shared_prefix_checkpoint": Setting(BOOL, (False,), WHY_MAMBA),
    "replayssm_buffer_len": Setting(INT, ANY, WHY_MAMBA),
    "use_replayssm": Setting(BOOL, (False,), WHY_MAMBA),
    "offload_backend": Setting(STR, ANY, WHY_OFFLOAD),
    "cpu_offload_gb": Setting(FLOAT, (0,), WHY_OFFLOAD),
    "cpu_offload_params": Setting(LIST, (None, [], set()), WHY_OFFLOAD),
    "offload_group_size": Setting(INT, (0,), WHY_OFFLOAD),
    "offload_num_in_group": Setting(INT, ANY, WHY_OFFLOAD),
    "offload_prefetch_step": Setting(INT, ANY, WHY_OFFLOAD),
    "offload_params": Setting(LIST, (None, [], set()), WHY_OFFLOAD),
    # multimodal
    "enable_mm_embeds": Setting(BOOL, (False,), WHY_TEXT),
    "media_io_kwargs": Setting(JSON, (None, {}), "images are decoded by PIL with jaxserve's "
                               "own limits (docs/VISION.md); no media loader options"),
    "mm_processor_cache_gb": Setting(FLOAT, ANY, WHY_TEXT),
    "mm_processor_cache_type": Setting(STR, ANY, WHY_TEXT),
    "mm_hasher_algorithm": Setting(STR, ANY, WHY_TEXT),
    "mm_shm_cache_max_object_size_mb": Setting(INT, ANY, WHY_TEXT),
    "mm_encoder_only": Setting(BOOL, (False,), WHY_TEXT),
    "mm_encoder_tp_mode": Setting(STR, ANY, WHY_TEXT),
    "mm_encoder_attn_backend": Setting(STR, ANY, WHY_TEXT),
    "mm_encoder_attn_dtype": Setting(STR, ANY, WHY_TEXT),
    "mm_encoder_fp8_scale_path": Setting(STR, ANY, WHY_TEXT),
    "mm_encoder_fp8_scale_save_path": Setting(STR, (None,), WHY_TEXT),
    "mm_encoder_fp8_scale_save_margin": Setting(FLOAT, ANY, WHY_TEXT),
    "interleave_mm_strings": Setting(BOOL, ANY, WHY_TEXT),
    "skip_mm_profiling": Setting(BOOL, ANY, WHY_TEXT),
    "video_pruning_rate": Setting(FLOAT, ANY, WHY_TEXT),
    "video_pruning_method": Setting(STR, ANY, WHY_TEXT),
    "mm_tensor_ipc": Setting(STR, ANY, WHY_TEXT),
    "mm_processor_device": Setting(STR, ANY, WHY_TEXT),
    "mm_ipc_gpu_memory_gb": Setting(FLOAT, ANY, WHY_TEXT),
    "mm_device_do_normalize": Setting(BOOL, ANY, WHY_TEXT),
    "disable_chunked_mm_input": Setting(BOOL, ANY, WHY_TEXT),
    # LoRA
    "enable_tower_connector_lora": Setting(BOOL, (False,), WHY_LORA),
    "fully_sharded_loras": Setting(BOOL, ANY, WHY_LORA),
    "lora_target_modules": Setting(LIST, (None, []), "each adapter's own target_modules "
                                   "(adapter_config.json) choose the modules it adapts"),
    "default_mm_loras": Setting(JSON, (None, {}), WHY_LORA),
    "specialize_active_lora": Setting(BOOL, ANY, WHY_LORA),
    "enable_mixed_moe_lora_format": Setting(BOOL, ANY, WHY_LORA),
    "enable_moe_shared_loras": Setting(BOOL, ANY, WHY_LORA),
    "max_lora_cls_labels": Setting(INT, ANY, WHY_LORA),
    # observability
    "logging_config": Setting(JSON, (None, {}), "jaxserve logs through Python's logging "
                              "(logger 'jaxserve'); set the level with --log-level"),
    "log_config_file": Setting(STR, (None,), "jaxserve logs through Python's logging "
                               "(logger 'jaxserve'); set the level with --log-level"),
    "show_hidden_metrics_for_version": Setting(STR, (None,), WHY_TRACE),
    "otlp_traces_endpoint": Setting(STR, (None,), WHY_TRACE),
    "collect_detailed_traces": Setting(LIST, (None, []), WHY_TRACE),
    "per_request_spec_decode_metrics": Setting(STR, ("none",), WHY_TRACE),
    "kv_cache_metrics": Setting(BOOL, (False,), WHY_TRACE),
    "kv_cache_metrics_sample": Setting(FLOAT, ANY, WHY_TRACE),
    "custom_histogram_buckets": Setting(JSON, (None,), WHY_TRACE),
    "cudagraph_metrics": Setting(BOOL, (False,), WHY_GRAPHS),
    "enable_layerwise_nvtx_tracing": Setting(BOOL, (False,), WHY_TRACE),
    "enable_mfu_metrics": Setting(BOOL, (False,), WHY_TRACE),
    "enable_logging_iteration_details": Setting(BOOL, (False,), WHY_TRACE),
    "profiler_config": Setting(JSON, (None, {}), WHY_TRACE),
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
    "scheduler_cls": Setting(STR, (None,), WHY_PLUGIN),
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
    "cudagraph_capture_sizes": Setting(LIST, (None, []), WHY_GRAPHS),
    "max_cudagraph_capture_size": Setting(INT, (None,), WHY_GRAPHS),
    # configs of parts jaxserve does not have
    "watermark_config": Setting(JSON, (None, {}), "output watermarking is not implemented"),
    "diffusion_config": Setting(JSON, (None, {}), "diffusion language models are not "
                                "implemented", short=("-dc",)),
    "kv_transfer_config": Setting(JSON, (None, {}), WHY_DISAGG),
    "kv_events_config": Setting(JSON, (None, {}), WHY_DISAGG),
    "ec_transfer_config": Setting(JSON, (None, {}), WHY_DISAGG),
    "ec_manager_config": Setting(JSON, ANY, WHY_DISAGG),
    "compilation_config": Setting(JSON, (None, {}), WHY_COMPILE + "; see --enforce-eager",
                                  short=("-cc",)),
    "optimization_level": Setting(STR, ("2", "O2", 2), WHY_COMPILE),
    "performance_mode": Setting(STR, ("balanced",), WHY_NOT),
    "engram_config": Setting(JSON, (None, {}), WHY_NOT),
    "reasoning_config": Setting(JSON, (None, {}), "reasoning output is split by "
                                "--reasoning-parser"),
    "additional_config": Setting(JSON, (None, {}), WHY_PLUGIN),
    "structured_outputs_config": Setting(JSON, guidance_backend, "structured outputs use "
                                         "llguidance: backend 'auto' or 'guidance'",
                                         sample={"backend": "guidance"}),
    "aux_output_config": Setting(JSON, (None, {}), WHY_NOT),
    "watchdog_config": Setting(JSON, ANY, "a failed engine step stops the server (exit 1) "
                               "for a supervisor to restart it"),
    "weight_transfer_config": Setting(JSON, (None, {}), WHY_NOT),
    # vLLM flags from before its current --help that vLLM users still type
    "max_num_partial_prefills": Setting(INT, (), "jaxserve (as vLLM V1) has no limit of "
                                        "prompts in prefill: their chunks share each step's "
                                        "--max-num-batched-tokens in queue order"),
    "max_long_partial_prefills": Setting(INT, (), "jaxserve (as vLLM V1) has no limit of "
                                         "prompts in prefill: their chunks share each step's "
                                         "--max-num-batched-tokens in queue order"),
    "task": Setting(STR, ("auto", "generate"), WHY_POOL),
    "device": Setting(STR, ("auto",), "JAX picks the platform (JAX_PLATFORMS chooses one)"),
    "num_scheduler_steps": Setting(INT, (1,), "one scheduling pass per step"),
    "tokenizer_pool_size": Setting(INT, (0,), "prompts are tokenized in the server's worker "
                                   "thread"),
    "guided_decoding_backend": Setting(STR, ("auto", "guidance"), "structured outputs use "
                                       "llguidance"),
}
