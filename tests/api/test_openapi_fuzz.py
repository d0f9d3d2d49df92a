"""A bounded schemathesis run over the live server's own /openapi.json.

A real `python -m jaxserve.api` process serves the tiny Qwen3 checkpoint; schemathesis
loads the schema the server publishes and Hypothesis draws a few hundred bodies, valid
ones and ones that break the schema, for every operation. No answer may be a server
error, and every answer must be one the schema documents (status code, content type,
body shape). Failures are collected rather than raised one by one, so one run names
them all; `pytest -s` prints the counts.

Checks (schemathesis names): not_a_server_error (and no error event >= 500 inside a 200
event stream, whose status cannot change any more), status_code_conformance,
content_type_conformance, response_headers_conformance, response_schema_conformance,
negative_data_rejection (a body that breaks the schema is a 4xx). Not
positive_data_acceptance: a body valid by the schema may rightly be refused for limits
no schema knows (prompt + max_tokens > max_model_len, token ids past the vocabulary).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from schemathesis import GenerationMode
from schemathesis.core.failures import Failure, FailureGroup

from tests.api.conftest import API_KEY, Server

# Examples per operation, (valid, invalid); operations without inputs stop after one.
EXAMPLES = {"POST /v1/completions": (100, 50), "POST /v1/chat/completions": (100, 50),
            "POST /tokenize": (40, 25), "POST /detokenize": (40, 25)}
SEED = 1                  # the same requests on every run against the same schema
BUDGET_S = 100.0          # a clean run takes ~20 s on 2 cores
# A valid count in [1, 128] is cut to 8 (or n to 4), to keep generation cheap; values
# outside (zero, negative, huge) are sent as drawn.
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8, "n": 4}
CHECKS = [schemathesis.checks.not_a_server_error,
          schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance,
          schemathesis.checks.response_headers_conformance,
          schemathesis.checks.response_schema_conformance,
          schemathesis.checks.negative_data_rejection]


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def steer(body: Any, model: str, vocab_size: int) -> None:
    """Moves a valid body past what the schema cannot say (the served model's name, token
    ids inside the vocabulary), so that it reaches the engine with all else as drawn."""
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = model
    ids = lambda xs: [x % vocab_size if is_int(x) else x for x in xs]   # noqa: E731
    if isinstance(body.get("prompt"), list):
        body["prompt"] = [ids(p) if isinstance(p, list) else p for p in ids(body["prompt"])]
    if isinstance(body.get("tokens"), list):
        body["tokens"] = ids(body["tokens"])


def cap_cost(body: Any) -> None:
    if isinstance(body, dict):
        for name, cap in CAPS.items():
            if is_int(body.get(name)) and 1 <= body[name] <= 128:
                body[name] = min(body[name], cap)


def stream_server_errors(resp) -> list[str]:
    """Messages of error events with code >= 500 inside an event stream."""
    if not (resp.headers.get("content-type") or [""])[0].startswith("text/event-stream"):
        return []
    found = []
    for line in resp.content.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {"):
            err = json.loads(line[6:]).get("error")
            if isinstance(err, dict) and err.get("code", 0) >= 500:
                found.append(str(err.get("message")))
    return found


def fuzz(url: str, headers: dict[str, str], vocab_size: int) -> dict[str, Any]:
    """Runs every operation's examples; returns counts and the distinct failures."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=headers)
    session = requests.Session()
    model = session.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
    report: dict[str, Any] = {"requests": 0, "server_errors": 0, "schema_failures": 0,
                              "statuses": {}, "failures": {}}
    t0 = time.monotonic()

    def send(case: schemathesis.Case, label: str, valid: bool) -> None:
        assert time.monotonic() - t0 < BUDGET_S, f"over the {BUDGET_S} s budget: {report}"
        if valid:
            if report["requests"] % 2:   # half go as drawn, half are steered to the engine
                steer(case.body, model, vocab_size)
            cap_cost(case.body)
        report["requests"] += 1
        resp = case.call(session=session, headers=headers, timeout=30)
        statuses = report["statuses"].setdefault(label, {})
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        try:
            case.validate_response(resp, checks=CHECKS, headers=headers)
            failures: list[Failure] = []
        except FailureGroup as group:
            failures = list(group.exceptions)
        except Failure as f:
            failures = [f]
        problems = [(f.title, (f.message or "").splitlines()[0] if f.message else "")
                    for f in failures]
        problems += [("server error event in a stream", m) for m in stream_server_errors(resp)]
        if resp.status_code >= 500 or any(p[0].startswith("server error") for p in problems):
            report["server_errors"] += 1
        elif problems:
            report["schema_failures"] += 1
        for title, message in problems:
            key = f"{label} -> {resp.status_code}: {title}: {message[:200]}"
            report["failures"].setdefault(key, json.dumps(case.body, default=repr)[:400])

    for result in schema.get_all_operations():
        operation = result.ok()
        label = operation.label
        for mode, n in zip((GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
                           EXAMPLES.get(label, (5, 5))):
            # One pass over n examples: failures are recorded, never raised or shrunk.
            @hypothesis.seed(SEED)
            @hypothesis.settings(max_examples=n, deadline=None, database=None,
                                 phases=[Phase.explicit, Phase.generate], print_blob=False,
                                 suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def draw(case: schemathesis.Case) -> None:
                send(case, label, valid=mode == GenerationMode.POSITIVE)

            try:
                draw()
            except hypothesis.errors.Unsatisfiable:
                pass   # no invalid request exists for an operation without inputs
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def test_openapi_fuzz(api_checkpoint: str) -> None:
    vocab_size = json.loads((Path(api_checkpoint) / "config.json").read_text())["vocab_size"]
    # The fewest rows and tokens a drawn request needs (n <= 4; a prompt longer than a step
    # is chunked): a fraction of the default sizes' warmup programs.
    srv = Server(api_checkpoint, "--max-num-seqs", "4", "--max-num-batched-tokens", "32")
    try:
        report = fuzz(srv.url, {"Authorization": f"Bearer {API_KEY}"}, vocab_size)
    finally:
        srv.stop()
    print(f"\nschemathesis {schemathesis.__version__}: {report['requests']} requests in "
          f"{report['seconds']} s, {report['server_errors']} server errors, "
          f"{report['schema_failures']} schema failures; statuses {report['statuses']}")
    for key, body in report["failures"].items():
        print(f"- {key}\n    e.g. {body}")
    assert report["requests"] >= 300
    assert report["server_errors"] == 0, report["failures"]
    assert report["schema_failures"] == 0, report["failures"]
