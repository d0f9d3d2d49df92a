"""A bounded schemathesis run over the live server's own /openapi.json (issue 15).

A real `python -m jaxserve.api` process serves the tiny Qwen3 checkpoint; schemathesis
loads the schema that the server publishes, and Hypothesis draws a few hundred request
bodies (valid ones and ones that break the schema) for every operation, then a handful
of fixed bodies that broke the server before. Every response must not be a server error
and must match the schema: a documented status code, a documented content type and a
body of the documented shape. Failures are collected, not raised one by one, so that one
run counts them all and names each distinct class with its smallest payload and the
server's traceback; `pytest -s` prints the summary.

Checks (schemathesis names):
- not_a_server_error: no 5xx. A stream cannot change its status once it has started, so
  an error event with code >= 500 inside a 200 event stream counts as a 5xx too, and so
  does a request that gets no answer within REQUEST_TIMEOUT_S.
- status_code_conformance, content_type_conformance, response_headers_conformance,
  response_schema_conformance: the response is one that the schema documents.
- negative_data_rejection: a body that breaks the schema is refused (4xx).
- Not positive_data_acceptance: a body that is valid by the schema may still be refused,
  correctly, for limits of the model and of the server's flags that no schema can know
  (prompt + max_tokens > max_model_len, token ids outside the vocabulary, a model name
  other than the served one), so a 400 there is no failure.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from schemathesis import GenerationMode
from schemathesis.core.failures import Failure, FailureGroup

from tests.api.conftest import API_KEY, Server

# Examples per operation: (valid bodies, invalid bodies). Operations without inputs have
# one possible request, and Hypothesis stops after it.
EXAMPLES = {"POST /v1/completions": (100, 50), "POST /v1/chat/completions": (100, 50),
            "POST /tokenize": (40, 25), "POST /detokenize": (40, 25)}
DEFAULT_EXAMPLES = (5, 5)
SEED = 1                    # fixed: the same requests on every run against the same schema
REQUEST_TIMEOUT_S = 15.0    # the tiny model answers any bounded request in well under 1 s
BUDGET_S = 75.0             # wall-clock bound on the run (a clean one takes ~20 s)
MAX_RESTARTS = 3            # fresh servers after one died or stalled, so later classes show

# Generation cost: a valid max_tokens / min_tokens is capped so that the run stays fast on
# 2 CPU cores; values outside [1, 128] (zero, negative, past max_model_len) are sent as
# drawn. n >= 1 is always capped: a huge n is one of the REGRESSIONS.
_CAPS = {"max_tokens": (1, 128, 8), "max_completion_tokens": (1, 128, 8),
         "min_tokens": (1, 128, 8), "n": (1, float("inf"), 4)}
# The ranges the server enforces on sampling numbers (SamplingParams), as [lo, hi].
_SAMPLING_RANGES = {"temperature": (0.0, float("inf")), "top_p": (1e-9, 1.0),
                    "min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
                    "frequency_penalty": (-2.0, 2.0), "repetition_penalty": (1e-9, float("inf"))}
# ... and the least value of its integers (the greatest are left alone: huge values are
# where the bugs were).
_INT_MINIMA = {"n": 1, "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 0,
               "top_k": -1, "logprobs": 0, "top_logprobs": 0}

# Bodies that broke the server (the fuzz report of issue 15), sent after the drawn ones:
# first those that fail alone, then those that kill the engine or stall the server.
_USER = [{"role": "user", "content": "hi"}]
REGRESSIONS: list[tuple[str, Any]] = [
    ("POST /v1/completions", {"prompt": "\ud800", "max_tokens": 2}),
    ("POST /tokenize", {"prompt": "\ud800"}),
    ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}],
                                   "max_tokens": 2}),
    ("POST /v1/chat/completions", {"messages": _USER, "max_tokens": 2,
                                   "chat_template_kwargs": {"tokenize": False}}),
    ("POST /v1/chat/completions", {"messages": _USER, "max_tokens": 2,
                                   "chat_template_kwargs": {"messages": []}}),
    ("POST /v1/chat/completions", {"messages": _USER, "max_tokens": 2,
                                   "chat_template_kwargs": {"tools": 5}}),
    ("POST /v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 2**31}),
    ("POST /v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 1,
                              "stop_token_ids": [2**31]}),
    ("POST /v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 100_000}),
]

_CHECKS = [schemathesis.checks.not_a_server_error,
           schemathesis.checks.status_code_conformance,
           schemathesis.checks.content_type_conformance,
           schemathesis.checks.response_headers_conformance,
           schemathesis.checks.response_schema_conformance,
           schemathesis.checks.negative_data_rejection]


@dataclass
class FailureClass:
    operation: str
    kind: str                   # the check's name, or "stream-5xx" / "no-answer"
    status: int | None
    detail: str                 # what tells this class apart from the others
    count: int = 0
    first_seen: int = 0         # the request number that first showed it
    first: str = ""             # that request's body (what broke the server, for hangs)
    payload: str = ""           # the smallest body seen for this class
    mode: str = ""              # how `payload` was made: positive / negative / regression
    server_log: str = ""        # the error and the traceback's last frame (5xx only)
    broke_server: str = ""      # "the engine died" / "the server stalled", when one did


@dataclass
class FuzzReport:
    requests: int = 0
    server_errors: int = 0      # 5xx responses, 5xx events in 200 streams, no answers
    schema_failures: int = 0    # responses failing a conformance or negative-data check
    by_operation: dict[str, dict[int, int]] = field(default_factory=dict)  # status -> n
    classes: dict[tuple, FailureClass] = field(default_factory=dict)
    out_of_budget: bool = False
    restarts: int = 0
    seconds: float = 0.0

    def add(self, key: tuple, payload: str, mode: str, server_log: str = "") -> None:
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = FailureClass(*key, first_seen=self.requests,
                                                   first=payload)
        cls.count += 1
        if not cls.payload or len(payload) < len(cls.payload):
            cls.payload, cls.mode = payload, mode
            cls.server_log = server_log or cls.server_log

    def summary(self) -> str:
        lines = [f"schemathesis {schemathesis.__version__}: {self.requests} requests in "
                 f"{self.seconds:.1f} s: {self.server_errors} server errors (5xx), "
                 f"{self.schema_failures} schema failures, {len(self.classes)} distinct "
                 f"failure classes, {self.restarts} server restarts"
                 + (" (stopped at the time budget)" if self.out_of_budget else ""),
                 "requests per operation (status: count):"]
        lines += [f"  {op}: {sum(st.values())} (" + ", ".join(
            f"{k}: {v}" for k, v in sorted(st.items())) + ")"
            for op, st in self.by_operation.items()]
        server_side = ("not_a_server_error", "stream-5xx", "no-answer")
        for c in sorted(self.classes.values(),
                        key=lambda c: (c.kind not in server_side, c.first_seen)):
            lines.append(f"- [{c.kind}] {c.operation} status={c.status} x{c.count}, first at "
                         f"request #{c.first_seen}: {c.detail}"
                         + (f" ({c.broke_server})" if c.broke_server else ""))
            lines.append(f"    smallest payload ({c.mode}): {c.payload[:500]}")
            if c.kind in server_side and c.first != c.payload:
                lines.append(f"    first payload: {c.first[:500]}")
            if c.server_log:
                lines.append("    server: " + c.server_log.replace("\n", "\n            "))
        return "\n".join(lines)


class _OutOfBudget(Exception):
    pass


def _dump(body: Any, known: set[str] | None = None) -> str:
    """The body as JSON; with `known` (the documented field names), without the others,
    which the server ignores and which Hypothesis draws in bulk."""
    if type(body).__name__ == "NotSet":
        return "(no body)"
    if isinstance(body, bytes):
        return f"raw bytes {body[:200]!r}"
    if known is not None and isinstance(body, dict) and set(body) - known:
        shown = {k: v for k, v in body.items() if k in known}
        return f"{json.dumps(shown, default=repr)} (+{len(body) - len(shown)} unknown fields)"
    return json.dumps(body, default=repr)


def _body_fields(raw_schema: dict, operation: schemathesis.APIOperation) -> set[str] | None:
    """The documented fields of an operation's JSON body (None: no object body)."""
    body = operation.definition.raw.get("requestBody", {})
    ref = body.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    name = ref.rsplit("/", 1)[-1]
    props = raw_schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties")
    return set(props) if props is not None else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _cap_cost(body: Any) -> None:
    """Caps the generation cost of a valid body (see _CAPS); leaves other values alone."""
    if isinstance(body, dict):
        for name, (lo, hi, cap) in _CAPS.items():
            if _is_int(body.get(name)) and lo <= body[name] <= hi:
                body[name] = min(body[name], cap)


def _steer(body: Any, model: str, vocab_size: int) -> None:
    """Moves a valid body past checks that the schema does not express (the served model's
    name, token ids inside its vocabulary, the sampling ranges), so that more bodies reach
    the engine with whatever else was drawn."""
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = model
    for name, (lo, hi) in _SAMPLING_RANGES.items():
        v = body.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not lo <= v <= hi:
            del body[name]
    for name, lo in _INT_MINIMA.items():
        if _is_int(body.get(name)) and body[name] < lo:
            del body[name]

    def ids(xs: list) -> list:
        return [x % vocab_size if _is_int(x) else x for x in xs]

    if isinstance(body.get("prompt"), list):
        body["prompt"] = [ids(p) if isinstance(p, list) else p for p in ids(body["prompt"])]
    if isinstance(body.get("tokens"), list):
        body["tokens"] = ids(body["tokens"])


def _stream_errors(resp: schemathesis.Response) -> list[dict]:
    """Error events with code >= 500 inside a text/event-stream body."""
    if not (resp.headers.get("content-type") or [""])[0].startswith("text/event-stream"):
        return []
    errors = []
    for line in resp.content.decode("utf-8", "replace").splitlines():
        if not line.startswith("data: {"):
            continue
        try:
            err = json.loads(line[6:]).get("error")
        except ValueError:
            continue
        if isinstance(err, dict) and _is_int(err.get("code")) and err["code"] >= 500:
            errors.append(err)
    return errors


_FRAME = re.compile(r'File "[^"]*?(jaxserve/[^"]+)", line (\d+), in (\S+)')
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b")


def _log_digest(log: str) -> tuple[str, str]:
    """(exception line, innermost jaxserve frame) of the last traceback in `log`."""
    if "Traceback" not in log:
        return "", ""
    tb = log[log.rindex("Traceback"):]
    frames = _FRAME.findall(tb)
    exc = next((ln for ln in reversed(tb.splitlines()) if _EXC_LINE.match(ln)), "")
    return exc, (f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else "")


def _normalize(text: str) -> str:
    """A message with its numbers and quoted values blanked, to group alike failures."""
    text = re.sub(r"'[^']*'|`[^`]*`", "'…'", text)
    return re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "N", text)[:200]


def _check_name(f: Failure) -> str:
    return f.checks[0] if getattr(f, "checks", None) else type(f).__name__


def _failure_detail(f: Failure, status: int) -> str:
    name = type(f).__name__
    if name == "UndefinedStatusCode":
        return f"{status} is not documented (documented: {', '.join(f.defined_status_codes)})"
    if name == "UndefinedContentType":
        return (f"content type {f.content_type!r} is not documented "
                f"(documented: {', '.join(f.defined_content_types)})")
    if name == "JsonSchemaError":
        return (f"body does not match {'/'.join(map(str, f.schema_path))}: "
                f"{_normalize(f.message.splitlines()[0])}")
    if name == "AcceptedNegativeData":
        part = next((ln for ln in f.message.splitlines() if ln.startswith("Invalid component")),
                    "")
        return f"invalid body accepted with {status}: {part[:200]}"
    return f"{f.title}: {_normalize(f.message.splitlines()[0] if f.message else '')}"


def run_fuzz(base_url: str, headers: dict[str, str], vocab_size: int,
             server_log: Callable[[], str] | None = None,
             restart: Callable[[], tuple[str, Callable[[], str]]] | None = None,
             seed: int = SEED, scale: float = 1.0) -> FuzzReport:
    """Runs the bounded property-based run against a live server; returns what it found.

    Every other valid body is steered to the engine (see _steer); the rest go as drawn.
    `restart()` (optional) replaces a server that died or stalled and returns the new
    one's (base url, log reader)."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers)
    report = FuzzReport()
    session = requests.Session()
    model = session.get(base_url + "/v1/models", headers=headers).json()["data"][0]["id"]
    drawn: dict[str, int] = {}
    broken = False   # the last request killed or stalled the server
    t0 = time.monotonic()
    log_seen = len(server_log()) if server_log else 0

    def new_log() -> str:
        nonlocal log_seen
        if server_log is None:
            return ""
        log = server_log()
        delta, log_seen = log[log_seen:], len(log)
        return delta

    def send(case: schemathesis.Case, label: str, mode: str) -> None:
        nonlocal base_url, server_log, log_seen, broken
        if time.monotonic() - t0 > BUDGET_S:
            report.out_of_budget = True
            raise _OutOfBudget
        if broken and restart is not None and report.restarts < MAX_RESTARTS:
            report.restarts += 1
            base_url, server_log = restart()
            log_seen, broken = 0, False
        if mode == "positive":
            drawn[label] = drawn.get(label, 0) + 1
            if drawn[label] % 2:
                _steer(case.body, model, vocab_size)
            _cap_cost(case.body)
        payload = _dump(case.body, fields.get(label))
        report.requests += 1
        statuses = report.by_operation.setdefault(label, {})
        try:
            resp = case.call(base_url=base_url, session=session, headers=headers,
                             timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as e:
            statuses[0] = statuses.get(0, 0) + 1   # 0: no answer
            report.server_errors += 1
            key = (label, "no-answer", None, _normalize(f"{type(e).__name__}: {e}"))
            new_log()
            report.add(key, payload, mode)
            after_server_error(key, stalled=True)
            return
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        log = new_log()
        try:
            case.validate_response(resp, checks=_CHECKS, headers=headers)
            failures: list[Failure] = []
        except FailureGroup as group:
            failures = list(group.exceptions)
        except Failure as f:
            failures = [f]
        # A 5xx counts once, as a server error, not again as an undocumented status code.
        failures = [f for f in failures if not (
            resp.status_code >= 500 and _check_name(f) == "status_code_conformance")]
        stream_errors = _stream_errors(resp)
        if resp.status_code >= 500 or stream_errors:
            report.server_errors += 1
        if any(_check_name(f) != "not_a_server_error" for f in failures):
            report.schema_failures += 1
        exc, where = _log_digest(log)
        key = None
        for f in failures:
            if _check_name(f) == "not_a_server_error":
                try:
                    message = str(resp.json()["error"]["message"])
                except Exception:  # noqa: BLE001 - any body will do as a description
                    message = resp.content[:200].decode("utf-8", "replace")
                detail = f"{_normalize(exc)} at {where}" if exc else _normalize(message)
                key = (label, "not_a_server_error", resp.status_code, detail)
                report.add(key, payload, mode, f"{message}\n{exc} at {where}" if exc else message)
            else:
                report.add((label, _check_name(f), resp.status_code,
                            _failure_detail(f, resp.status_code)), payload, mode)
        for err in stream_errors:
            message = str(err.get("message"))
            key = (label, "stream-5xx", resp.status_code, _normalize(message))
            report.add(key, payload, mode, f"{message}\n{exc} at {where}" if exc else message)
        if key is not None:
            after_server_error(key)

    def after_server_error(key: tuple, stalled: bool = False) -> None:
        """Notes a server that the last request killed or stalled; the next request gets
        a fresh one (while restarts are left)."""
        nonlocal broken
        if not stalled:
            try:
                # A fresh connection: the server drops the one that carried a 500.
                if requests.get(base_url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
        cls = report.classes[key]
        cls.broke_server = cls.broke_server or (
            "the server stalled" if stalled else "the engine died")
        broken = True

    operations = {op.label: op for op in (r.ok() for r in schema.get_all_operations())}
    fields = {label: _body_fields(schema.raw_schema, op) for label, op in operations.items()}
    try:
        for label, operation in operations.items():
            for mode, n in zip((GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
                               EXAMPLES.get(label, DEFAULT_EXAMPLES)):
                # Failures are recorded, never raised: no shrinking, one pass of n examples.
                @hypothesis.seed(seed)
                @hypothesis.settings(max_examples=max(1, int(n * scale)), deadline=None,
                                     database=None, derandomize=False, print_blob=False,
                                     phases=[Phase.explicit, Phase.generate],
                                     suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def draw(case: schemathesis.Case) -> None:
                    send(case, label, mode.value)

                try:
                    draw()
                except hypothesis.errors.Unsatisfiable:
                    pass   # no invalid request exists for an operation without inputs
        for label, body in REGRESSIONS:
            send(operations[label].Case(body=body, media_type="application/json"), label,
                 "regression")
    except _OutOfBudget:
        pass
    report.seconds = time.monotonic() - t0
    session.close()
    return report


def test_openapi_fuzz(api_checkpoint: str) -> None:
    vocab_size = json.loads((Path(api_checkpoint) / "config.json").read_text())["vocab_size"]
    servers = [Server(api_checkpoint)]

    def restart() -> tuple[str, Callable[[], str]]:
        servers[-1].stop(timeout=5)
        servers.append(Server(api_checkpoint))
        return servers[-1].url, servers[-1].output

    try:
        report = run_fuzz(servers[0].url, {"Authorization": f"Bearer {API_KEY}"}, vocab_size,
                          servers[0].output, restart)
    finally:
        servers[-1].stop(timeout=5)
    print("\n" + report.summary())   # also in the captured stdout of a failure
    requests_sent, server_errors, schema_failures = (
        report.requests, report.server_errors, report.schema_failures)
    assert requests_sent >= 300 and not report.out_of_budget, "the run was cut short"
    assert server_errors == 0, "5xx answers (or none): see the summary printed above"
    assert schema_failures == 0, "responses off the schema: see the summary printed above"
