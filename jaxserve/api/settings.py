"""ServerSettings: what the HTTP server was told (its flags), as opposed to the engine's
EngineConfig. Built once by the CLI (cli/serve.py) and read by every endpoint family."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.api.log_values import DEFAULT_MAX_LOG_LEN


@dataclass(frozen=True)
class ServerSettings:
    # --served-model-name: requests may name any; answers and metrics carry the first.
    served_model_names: tuple[str, ...]
    max_model_len: int
    api_key: tuple[str, ...] | str | None = None   # --api-key: any of them is let in
    max_waiting_requests: int = 1024
    disable_log_requests: bool = False
    chat_template: str | None = None
    generation_defaults: dict = field(default_factory=dict)
    max_request_body_bytes: int = 32 * 2**20
    auto_tool_parser: str | None = None     # --tool-call-parser, with --enable-auto-tool-choice
    reasoning_parser: str | None = None     # --reasoning-parser
    disable_log_stats: bool = False         # no periodic stats line (api/stats_logger.py)
    log_stats_interval: float = 10.0        # seconds between two stats lines
    enable_tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (off, as vLLM)
    max_log_len: int = DEFAULT_MAX_LOG_LEN  # --max-log-len: each value a log line shows
    # --default-chat-template-kwargs: under each request's own chat_template_kwargs.
    default_chat_template_kwargs: dict = field(default_factory=dict)
    disable_fastapi_docs: bool = False      # no /docs, /redoc, /openapi.json

    def __post_init__(self) -> None:
        names = self.served_model_names
        # One name as a bare string would otherwise become a tuple of its characters.
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served_model_names must be one or more non-empty names, "
                             f"got {self.served_model_names!r}")
        object.__setattr__(self, "served_model_names", names)
        keys = self.api_key
        object.__setattr__(self, "api_key", () if not keys else (keys,) if isinstance(keys, str)
                           else tuple(keys))

    @property
    def served_model_name(self) -> str:
        """The name answers carry (the first served name)."""
        return self.served_model_names[0]
