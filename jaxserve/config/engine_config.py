"""EngineConfig: every engine knob in one frozen, validated dataclass.

A knob with a command-line flag carries its help text (and flag aliases, choices) as
field metadata: jaxserve/config/engine_args.py makes the flags of the server, the planner and
`python -m jaxserve.generate` from these fields, so a flag's name, type and default
are the field's own."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

# (no jax: plain modules of model and cache-dtype facts)
from models.config import SERVING_DTYPES, WEIGHT_QUANT_DTYPES
from pallas_kernels.kv_cache_dtypes import KV_QUANT_DTYPE_NAMES
from jaxserve.config.lora import LORA_DTYPES, check_lora_settings
from jaxserve.config.media import MediaConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.errors import ConfigError
from jaxserve.sampling_params import MAX_LOGPROBS

# vLLM's other spellings of --dtype, taken as the dtype they name.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_DTYPES = ("auto", *SERVING_DTYPES)
_DTYPE_CHOICES = (*_DTYPES, *DTYPE_ALIASES)
_KV_CACHE_DTYPES = (*_DTYPES, *KV_QUANT_DTYPE_NAMES)
_QUANTIZATIONS = tuple(WEIGHT_QUANT_DTYPES)
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_POLICIES = ("fcfs", "priority")
# "auto": chosen by platform (pallas_kernels' resolve_backend owns the rule); "reference": the
# simple jnp oracle; "pallas_interpret": the Pallas kernel body in interpret mode on CPU
# (tests; slow).
_ATTENTION_BACKENDS = ("auto", "xla", "reference", "pallas", "pallas_interpret")


# The accelerators' share of the device for the engine (--gpu-memory-utilization).
DEFAULT_HBM_UTILIZATION = 0.9


def default_max_num_seqs(platform: str) -> int:
    """max_num_seqs when none is given, for the platform the engine runs on ("cpu",
    "gpu", "tpu"). Each sampler row bucket up to max_num_seqs is a warmup program
    (runner/buckets.py), and on CPU each token bucket of a decode's size: there 64
    keeps the built-in tiny model's server at its budget of 24 programs (more rows, more
    programs; tests/engine/test_warmup_budget.py);
    accelerators take vLLM's 256, where the programs are worth the batch (the TPU plans
    and compile checks are made at 256), so one number cannot serve both. LLM, the
    server and the planner all take it from here."""
    return 64 if platform == "cpu" else 256


def _knob(default: Any = dataclasses.MISSING, *, help: str, aliases: tuple[str, ...] = (),
          choices: tuple[str, ...] | None = None, default_help: str | None = None,
          default_factory: Any = dataclasses.MISSING, nargs: str | None = None) -> Any:
    """A field with a command-line flag: --field-name, plus `aliases` (vLLM spellings).
    default_help: what the default means where the value alone would not say; nargs:
    the flag takes several values (argparse's nargs)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "aliases": aliases, "choices": choices,
                                       "default_help": default_help, "nargs": nargs})


def compilation_cache_setting(value: str | None) -> str | None:
    """A compilation cache setting as given (flag, environment, Python): '' or 'none' (any
    case) turns the cache off (None); a path has its ~ expanded."""
    if value is None or value.strip().lower() in ("", "none"):
        return None
    return os.path.expanduser(value)


def _compilation_cache_default() -> str:
    """As given: __post_init__ reads it as every setting is read (compilation_cache_setting)."""
    return os.environ.get("JAXSERVE_COMPILATION_CACHE", "~/.cache/jaxserve/xla")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = _knob(None, help="tokenizer directory or Hugging Face repo id",
                                  default_help="the model's")
    revision: str | None = _knob(
        None, help="the model's branch, tag or commit on the Hugging Face hub (downloads and "
                   "the local HF cache)", default_help="main")
    download_dir: str | None = _knob(
        None, help="where a model downloaded from the Hugging Face hub is kept",
        default_help="the HF cache: HF_HUB_CACHE, else HF_HOME/hub")
    trust_remote_code: bool = _knob(
        False, help="accepted as vLLM does; jaxserve runs only its own model code, so a "
                    "checkpoint that needs its own Python code (config.json auto_map) is "
                    "refused with or without it")
    dtype: str = _knob("auto", choices=_DTYPE_CHOICES,
                       help="weights and activations; auto = the checkpoint's dtype, half = "
                            "float16, float = float32")
    kv_cache_dtype: str = _knob(
        "auto", choices=_KV_CACHE_DTYPES,
        help="KV cache dtype; auto = the model dtype. fp8 (= fp8_e4m3), fp8_e5m2 and int8 "
             "store it quantized with a scale per layer and KV head for K and V")
    calculate_kv_scales: bool = _knob(
        False, help="fp8 KV cache: measure the K and V scales of each layer and KV head at "
                    "start-up on a calibration prefill instead of using 1 (a head with small "
                    "keys keeps its precision); int8 KV scales are always measured; refused "
                    "without a quantized --kv-cache-dtype")
    quantization: str | None = _knob(
        None, aliases=("-q",), choices=_QUANTIZATIONS,
        help="store the linear layers' weights in fp8 (float8_e4m3fn) or int8, one scale per "
             "output channel, quantized at load (not embeddings, norms, the lm_head or MoE "
             "routers); an fp8 checkpoint is served in its own fp8 blocks without this flag",
        default_help="the checkpoint's own quantization, else none")
    activation_quantization: str | None = _knob(
        None, choices=("dynamic",),
        help="with --quantization: also quantize each token's activations to the weights' "
             "dtype in the step (per-token scale) and multiply in it -- w8a8, for int8 or fp8 "
             "matrix units (TPU v5e/v6e int8, H100 fp8); without it activations stay in the "
             "model dtype (w8a16)", default_help="none (w8a16)")
    max_model_len: int | None = _knob(None, help="context length (prompt + output)",
                                      default_help="the model's max_position_embeddings")
    # None = default_max_num_seqs for the platform, resolved at construction.
    max_num_seqs: int | None = _knob(None, help="most requests in one step",
                                     default_help="64 on CPU, 256 on GPU/TPU")
    max_num_batched_tokens: int | None = _knob(None, help="token budget of one step",
                                               default_help="max(2048, max_num_seqs)")
    page_size: int = _knob(16, aliases=("--block-size",), help="tokens per KV cache page")
    seed: int = _knob(0, help="engine seed (for requests without a seed)")
    enable_prefix_caching: bool = _knob(True, help="reuse the KV pages of shared prompt "
                                                   "prefixes")
    load_format: str = _knob("auto", choices=_LOAD_FORMATS,
                             help="dummy = random weights at the model's real shape")
    scheduling_policy: str = _knob("fcfs", choices=_POLICIES, help="order of the waiting "
                                                                   "requests")
    num_pages: int | None = _knob(
        None, aliases=("--num-gpu-blocks-override",),
        help="KV cache pages per layer, the null page included, in place of sizing them by "
             "memory", default_help="sized by --gpu-memory-utilization")
    # None: DEFAULT_HBM_UTILIZATION on accelerators (for_platform); on CPU a quarter of
    # the free RAM, taken only as far as max_num_seqs sequences need.
    hbm_utilization: float | None = _knob(
        None, aliases=("--gpu-memory-utilization", "--device-memory-utilization"),
        help="share of the device's memory the engine holds, as vLLM's: weights + KV cache "
             "+ a reserve for the programs' temporaries (JAX's GPU pool is set to it before "
             "JAX starts); on CPU: the KV cache's share of the free RAM",
        default_help=f"{DEFAULT_HBM_UTILIZATION} on GPU/TPU; on CPU a quarter of the free "
                     f"RAM, only as much as max_num_seqs sequences need")
    kv_cache_memory_bytes: int | None = _knob(
        None, help="the KV cache's bytes per device, in place of --gpu-memory-utilization",
        default_help="sized by --gpu-memory-utilization")
    kv_offloading_size: float | None = _knob(
        None, help="GiB of host memory for a second tier of the prefix cache (vLLM's flag): "
                   "KV pages (and a hybrid's state snapshots) the device pool evicts are "
                   "copied there and restored on a later prefix hit instead of recomputed; "
                   "each data-parallel replica holds its own tier of this size",
        default_help="none: evicted pages are dropped")
    kv_offloading_backend: str = _knob(
        "native", choices=("native",),
        help="the host tier's implementation: only native (jaxserve's own copies)")
    mesh: str | None = _knob(None, help="device mesh 'DxM': D data-parallel replicas, each "
                                        "tensor parallel over M devices", default_help="1x1")
    tensor_parallel_size: int | None = _knob(
        None, aliases=("-tp",), help="devices each replica is tensor parallel over: the M of "
                                     "--mesh DxM", default_help="--mesh's M, else 1")
    enable_expert_parallel: bool = _knob(
        False, aliases=("-ep",), help="MoE models: split the experts whole over the model axis (each device "
                    "holds num_experts/M of them) instead of every expert's width (tensor "
                    "parallel); needs M > 1 dividing num_experts, refused for a dense model")
    data_parallel_size: int | None = _knob(
        None, aliases=("-dp",), help="data-parallel replicas: the D of --mesh DxM",
        default_help="--mesh's D, else 1")
    pipeline_parallel_size: int = _knob(
        1, aliases=("-pp",), help="pipeline stages; only 1: jaxserve has no pipeline "
                                  "parallelism (use -tp, or --mesh, across hosts)")
    max_logprobs: int = _knob(
        MAX_LOGPROBS, help="most logprobs (and prompt_logprobs) a request may ask for; more is refused "
                 "(400); -1: the vocabulary size")
    enforce_eager: bool = _knob(
        False, help="skip warmup and compile each program when a step first needs it: a "
                    "faster start, slow first requests (XLA always compiles: there is no "
                    "eager mode)")
    enable_chunked_prefill: bool = _knob(
        True, help="split long prompts over steps of --max-num-batched-tokens; always on "
                   "(--no-enable-chunked-prefill is refused)")
    async_scheduling: bool = _knob(
        False, help="overlap the host's work with the device step: step N+1 is scheduled "
                    "and dispatched before step N's tokens are read back (its input tokens "
                    "taken on the device); steps run in order where a feature needs the "
                    "tokens first (structured outputs, penalties, multi-token bad_words, "
                    "images, speculative decoding, the host KV tier, a hybrid's prefix caching, "
                    "multi-host, data parallel), logged once")
    preemption_mode: str = _knob(
        "recompute", choices=("recompute", "swap"),
        help="what a preempted request loses: recompute (its KV pages, computed again when "
             "it resumes); swap (to host memory) is refused, jaxserve never swaps")
    swap_space: float = _knob(
        0.0, help="GiB of host memory for swapped-out KV: only 0, jaxserve preempts by "
                  "recomputation and never swaps")
    speculative_config: SpeculativeConfig | None = _knob(
        None, aliases=("-sc",), help="speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 5, "
                   "\"prompt_lookup_min\": 2}; outputs are the same as without it (greedy: "
                   "identical; sampled: the same distribution, and identical for a seed)",
        default_help="off")
    attention_backend: str = _knob("auto", choices=_ATTENTION_BACKENDS,
                                   help="auto: Pallas kernels on GPU/TPU, XLA on CPU")
    # Layers under jax.lax.scan (one compiled layer body whatever the depth) or a Python
    # loop; None = scan on accelerators, loop on CPU (for_platform).
    scan_layers: bool | None = None
    # Images in (jaxserve/multimodal), vLLM's flags.
    limit_mm_per_prompt: dict[str, Any] | None = _knob(
        None, help='JSON, e.g. \'{"image": 4}\': most images per prompt (video and audio: 0)',
        default_help='{"image": 16}')
    allowed_local_media_path: str = _knob(
        "", help="directory whose files requests may name as file:// image URLs ('': none)")
    mm_processor_kwargs: dict[str, Any] | None = _knob(
        None, help="JSON of image processor settings (e.g. '{\"max_pixels\": 1003520}')")
    language_model_only: bool = _knob(
        False, help="serve the text model alone of a vision-language checkpoint: images are "
                    "refused")
    # LoRA adapters (docs/LORA.md), vLLM's flags.
    enable_lora: bool = _knob(
        False, help="serve LoRA adapters on the base model: a request names one (the "
                    "server's `model`, LLM.generate's lora_request) and adapters of "
                    "different requests run in the same step")
    lora_modules: tuple[Any, ...] | None = _knob(
        None, nargs="+", help="adapters served by name: name=path, or vLLM's JSON "
                              "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                              "needs --enable-lora", default_help="none")
    max_loras: int = _knob(1, help="adapters on the device at once (slots; a request whose "
                                   "adapter finds no free slot waits)")
    max_lora_rank: int = _knob(16, help="largest adapter rank served (the slots' width; a "
                                        "higher rank is refused)")
    max_cpu_loras: int | None = _knob(None, help="adapters kept loaded on the host (at least "
                                                 "--max-loras)", default_help="--max-loras")
    lora_dtype: str = _knob("auto", choices=LORA_DTYPES,
                            help="the adapters' dtype on the device; auto = what the model's "
                                 "projections multiply in (the model's dtype, float32 on a "
                                 "CPU that upcasts bf16 weights)")
    compilation_cache_dir: str | None = _knob(
        default_factory=_compilation_cache_default,
        help="persistent XLA compilation cache: a second start loads the programs compiled "
             "by the first from here instead of compiling them again; '' or 'none' turns it off",
        default_help="env JAXSERVE_COMPILATION_CACHE (where '' or 'none' turns it off too), "
                     "else ~/.cache/jaxserve/xla")

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(field, f"{field}={getattr(self, field)!r}: {why}")

        if not self.model:
            raise ConfigError("model", "model must name a checkpoint directory")
        MediaConfig.from_settings(limit_mm_per_prompt=self.limit_mm_per_prompt,
                                  allowed_local_media_path=self.allowed_local_media_path,
                                  mm_processor_kwargs=self.mm_processor_kwargs)
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        object.__setattr__(self, "compilation_cache_dir",
                           compilation_cache_setting(self.compilation_cache_dir))
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {_DTYPE_CHOICES}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {_KV_CACHE_DTYPES}")
        if self.quantization is not None and self.quantization not in _QUANTIZATIONS:
            raise bad("quantization", f"must be one of {_QUANTIZATIONS} (or unset)")
        if self.activation_quantization not in (None, "dynamic"):
            raise bad("activation_quantization", "must be 'dynamic' (or unset)")
        if self.calculate_kv_scales and self.kv_cache_dtype not in KV_QUANT_DTYPE_NAMES:
            raise bad("calculate_kv_scales", f"scales belong to a quantized KV cache, and "
                      f"kv_cache_dtype={self.kv_cache_dtype!r} stores K and V as they are; "
                      f"give --kv-cache-dtype fp8 (or int8), or leave the flag out")
        if self.load_format not in _LOAD_FORMATS:
            raise bad("load_format", f"must be one of {_LOAD_FORMATS}")
        if self.scheduling_policy not in _POLICIES:
            raise bad("scheduling_policy", f"must be one of {_POLICIES}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {_ATTENTION_BACKENDS}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise bad("page_size", "must be a positive power of two")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise bad("max_num_batched_tokens", "must be >= 16")
        if self.num_pages is not None and self.num_pages < 2:
            raise bad("num_pages", "must be >= 2 (page 0 is the reserved null page)")
        if self.hbm_utilization is not None and not 0.0 < self.hbm_utilization <= 1.0:
            raise bad("hbm_utilization", "must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise bad("kv_cache_memory_bytes", "must be > 0")
        if self.kv_offloading_size is not None and not self.kv_offloading_size >= 0:
            raise bad("kv_offloading_size", "must be >= 0 GiB (0 or unset: no host tier)")
        if self.kv_offloading_backend != "native":
            raise bad("kv_offloading_backend", "only 'native' (jaxserve's own host tier) is "
                      "implemented; vLLM's KV connectors are not")
        if self.max_num_seqs is not None and self.num_batched_tokens < self.max_num_seqs:
            raise bad("max_num_batched_tokens", f"must be >= max_num_seqs ({self.max_num_seqs})")
        if self.max_logprobs < -1:
            raise bad("max_logprobs", "must be >= 0, or -1 for the vocabulary size")
        try:
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))
        except (ValueError, TypeError) as e:
            raise ConfigError("speculative_config", str(e)) from None
        check_lora_settings(self, bad)
        self._check_refused(bad)
        self._resolve_mesh(bad)

    def _check_refused(self, bad) -> None:
        """vLLM's settings that have no jaxserve meaning: their one value that does."""
        if self.pipeline_parallel_size != 1:
            raise bad("pipeline_parallel_size", "jaxserve has no pipeline parallelism; split "
                      "the model with --tensor-parallel-size (or --mesh 1xM), across hosts too")
        if not self.enable_chunked_prefill:
            raise bad("enable_chunked_prefill", "chunked prefill is always on in jaxserve "
                      "(a prompt longer than --max-num-batched-tokens runs over several steps)")
        if self.preemption_mode != "recompute":
            raise bad("preemption_mode", "jaxserve preempts by recomputation only (a preempted "
                      "request's KV pages are freed and computed again when it resumes)")
        if self.swap_space != 0:
            raise bad("swap_space", "jaxserve never swaps KV pages to host memory (it preempts "
                      "by recomputation): leave --swap-space out, or give 0")

    def _resolve_mesh(self, bad) -> None:
        """mesh "DxM" and -dp D / -tp M are one setting: given both, they must agree;
        -tp/-dp alone make the mesh (the engine reads only `mesh`)."""
        d = m = 1
        if self.mesh is not None:
            # sharding owns the "DxM" format; imported here so that importing this
            # module needs no jax.
            from sharding.mesh import parse_mesh
            try:
                d, m = parse_mesh(self.mesh)
            except ValueError as e:
                raise ConfigError("mesh", str(e)) from e
        for name, size, from_mesh in (("tensor_parallel_size", self.tensor_parallel_size, m),
                                      ("data_parallel_size", self.data_parallel_size, d)):
            if size is None:
                continue
            if size < 1:
                raise bad(name, "must be >= 1")
            if self.mesh is not None and size != from_mesh:
                raise bad(name, f"disagrees with mesh={self.mesh!r} (D x M = data x tensor "
                                f"parallel); give one of them")
        if self.mesh is None and (self.tensor_parallel_size or self.data_parallel_size):
            object.__setattr__(self, "mesh", f"{self.data_parallel_size or 1}x"
                                             f"{self.tensor_parallel_size or 1}")

    @property
    def kv_offloading_bytes(self) -> int:
        """The prefix cache's host tier in bytes (0: none)."""
        return int((self.kv_offloading_size or 0) * 2**30)

    @property
    def num_batched_tokens(self) -> int:
        """The per-step token budget (max_num_batched_tokens with its default)."""
        return self.max_num_batched_tokens or max(2048, self.max_num_seqs or 0)

    def for_platform(self, platform: str) -> EngineConfig:
        """This config with the defaults that depend on the platform ("cpu", "gpu",
        "tpu") filled in: what an engine on that platform runs (validated again)."""
        utilization = self.hbm_utilization
        if utilization is None and platform != "cpu":
            utilization = DEFAULT_HBM_UTILIZATION
        return dataclasses.replace(
            self, max_num_seqs=self.max_num_seqs or default_max_num_seqs(platform),
            hbm_utilization=utilization,
            # XLA:CPU copies scanned weights out of their stack: loop there.
            scan_layers=platform != "cpu" if self.scan_layers is None else self.scan_layers)
