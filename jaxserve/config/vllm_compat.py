"""vLLM's settings that have no jaxserve knob: the values that are true of jaxserve (taken,
and said at start-up) and why any other is refused.

`vllm serve` has some three hundred flags; most tune parts jaxserve does not have (CUDA
graphs, NCCL, Ray, multimodal encoders, KV transfer, ...). A vLLM command line must
still start jaxserve or stop it with a reason, never "unrecognized arguments": every flag
of vLLM's that is not an EngineConfig field or a server setting of jaxserve's is listed
here. ENGINE holds vLLM's engine arguments (flags of the server and the planner, and
`LLM(...)` keywords); FRONTEND the HTTP server's. Host only: no jax.
"""
from __future__ import annotations

from jaxserve.config.vllm_engine import ENGINE
# (the Setting names re-exported: vllm_compat is the tables' public module)
from jaxserve.config.vllm_settings import (ANY, BOOL, FLOAT, INT, JSON, LIST, OPTIONAL, STR,
                                           SWITCH, Setting, WHY_DP, WHY_MULTI, WHY_NOT,
                                           WHY_PLUGIN, WHY_POOL, WHY_TEXT, parse_json)

__all__ = ["ENGINE", "FRONTEND", "Setting", "parse_json", "ANY", "BOOL", "FLOAT", "INT",
           "JSON", "LIST", "OPTIONAL", "STR", "SWITCH"]

# vLLM's HTTP server flags (FrontendArgs and vllm serve's own) that jaxserve has no
# setting for: `jaxserve serve` only.
FRONTEND: dict[str, Setting] = {
    "headless": Setting(SWITCH, (False,), WHY_MULTI + "; hosts other than process 0 serve no "
                        "HTTP already"),
    "api_server_count": Setting(INT, (None, 1), "one HTTP server per engine (the engine "
                                "runs in its own thread)", short=("-asc",)),
    "grpc": Setting(SWITCH, (False,), "no gRPC server: the OpenAI-compatible HTTP API only"),
    "grpc_port": Setting(INT, (None,), "no gRPC server: the OpenAI-compatible HTTP API only"),
    "chat_template_content_format": Setting(STR, ("string",), "message content is given to "
                                            "the chat template as a string (text parts "
                                            "joined)"),
    "trust_request_chat_template": Setting(BOOL, (False,), "a chat template in a request is "
                                           "refused (400); the server's is used"),
    "trust_request_mm_kwargs": Setting(BOOL, (False,), WHY_TEXT),
    "reasoning_effort_map": Setting(JSON, (None, {}), "a request's reasoning_effort is "
                                    "refused by name; use chat_template_kwargs"),
    "response_role": Setting(STR, ("assistant",), "the answer's role is 'assistant'"),
    "return_tokens_as_token_ids": Setting(BOOL, (False,), WHY_NOT),
    "exclude_tools_when_tool_choice_none": Setting(BOOL, (False,), "with tool_choice 'none' "
                                                   "the tools still reach the chat template"),
    "tool_parser_plugin": Setting(STR, ("",), WHY_PLUGIN),
    "tool_strict_level": Setting(STR, (None,), WHY_NOT),
    "tool_server": Setting(STR, (None,), "no built-in tool servers"),
    "enable_prompt_tokens_details": Setting(BOOL, (False,), WHY_NOT),
    "enable_per_request_metrics": Setting(BOOL, (False,), WHY_NOT),
    "enable_server_load_tracking": Setting(BOOL, ANY, "the load is always tracked: GET /load"),
    "enable_force_include_usage": Setting(BOOL, (False,), "a stream carries usage when "
                                          "stream_options.include_usage asks for it"),
    "sse_keep_alive_interval": Setting(INT, (0,), WHY_NOT),
    "enable_log_outputs": Setting(BOOL, (False,), WHY_NOT),
    "enable_log_deltas": Setting(BOOL, ANY, "only with --enable-log-outputs"),
    "cohere_is_reasoning_model": Setting(BOOL, ANY, "jaxserve has no Cohere API"),
    "cohere_format": Setting(STR, ANY, "jaxserve has no Cohere API"),
    "anthropic_disabled_thinking_effort": Setting(STR, ANY, "jaxserve has no Anthropic "
                                                  "Messages API"),
    "log_error_stack": Setting(BOOL, (False,), WHY_NOT),
    "tokens_only": Setting(BOOL, (False,), WHY_NOT),
    "enable_scale_out": Setting(BOOL, (False,), WHY_NOT),
    "fingerprint_mode": Setting(STR, ("none",), "answers carry no system_fingerprint"),
    "fingerprint_value": Setting(STR, (None,), "answers carry no system_fingerprint"),
    "data_parallel_supervisor_port": Setting(INT, (9256,), WHY_DP),
    "dp_supervisor_probe_interval_s": Setting(FLOAT, (5.0,), WHY_DP),
    "dp_supervisor_probe_timeout_s": Setting(FLOAT, (5.0,), WHY_DP),
    "dp_supervisor_probe_failure_threshold": Setting(INT, (3,), WHY_DP),
    "disable_access_log_for_endpoints": Setting(STR, (None,), "not implemented; "
                                                "--disable-uvicorn-access-log turns the whole "
                                                "access log off"),
    "enable_ssl_refresh": Setting(BOOL, (False,), WHY_NOT),
    "middleware": Setting(LIST, (None, []), WHY_PLUGIN),
    "enable_request_id_headers": Setting(BOOL, (False,), WHY_NOT),
    "h11_max_header_count": Setting(INT, (256,), WHY_NOT),
    "enable_offline_docs": Setting(BOOL, (False,), WHY_NOT),
    "enable_flash_late_interaction": Setting(BOOL, ANY, WHY_POOL),
}
