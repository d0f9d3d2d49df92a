"""`jaxserve serve MODEL` as a vLLM user types it: the console script, a --config YAML
file, several served names, CORS, HTTPS and a root path, in one real server."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

import jaxserve
from tests.api.conftest import API_KEY, Server

# pip puts the script beside the interpreter (a venv's bin/, on PATH or not).
_BESIDE = os.path.join(os.path.dirname(sys.executable), "jaxserve")
JAXSERVE = _BESIDE if os.path.isfile(_BESIDE) else shutil.which("jaxserve")


def test_console_script_is_installed_and_has_a_version():
    assert JAXSERVE, "the jaxserve console script is not installed (pip install -e .)"
    out = subprocess.run([JAXSERVE, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"jaxserve {jaxserve.__version__}"
    bad = subprocess.run([JAXSERVE, "sevre"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'sevre'" in bad.stderr


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "key.pem", d / "cert.pem"


def test_serve_with_config_file_names_cors_https_and_root_path(api_checkpoint, tls,
                                                               tmp_path):
    key, cert = tls
    config = tmp_path / "serve.yaml"
    config.write_text(f"served-model-name: [tiny, tiny-alias]\n"
                      f"allowed-origins: ['https://client.example']\n"
                      f"ssl-keyfile: {key}\nssl-certfile: {cert}\n"
                      f"override-generation-config: {{temperature: 0.0}}\n")
    srv = Server(None, "--config", str(config), "--root-path", "/llm",
                 "--enable-tokenizer-info-endpoint",
                 launcher=(JAXSERVE, "serve", api_checkpoint), log_dir=str(tmp_path),
                 https=True)
    try:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=srv.url, verify=False, headers=auth, timeout=60) as c:
            models = c.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
            # The second name is served too; answers carry the first. No temperature
            # given: the override's greedy decoding, so both answers are the same.
            answers = [c.post("/v1/completions", json={"model": name, "prompt": "hello",
                                                       "max_tokens": 6})
                       for name in ("tiny-alias", "tiny")]
            assert [a.status_code for a in answers] == [200, 200], answers[0].text
            assert answers[0].json()["model"] == "tiny"
            assert answers[0].json()["choices"][0]["text"] == \
                answers[1].json()["choices"][0]["text"]
            assert c.post("/v1/completions", json={"model": "other", "prompt": "x"}
                          ).status_code == 404
            info = c.get("/tokenizer_info")
            assert info.status_code == 200 and info.json()["max_model_len"] == 128
            # Behind a proxy that strips the prefix: the routes answer as they are, and
            # the API description tells clients where the proxy serves them.
            assert c.get("/openapi.json").json().get("servers") == [{"url": "/llm"}]
            # CORS: the allowed origin is let in, another is not.
            pre = {"Access-Control-Request-Method": "POST"}
            ok = c.options("/v1/completions", headers={"Origin": "https://client.example", **pre})
            assert ok.headers.get("access-control-allow-origin") == "https://client.example"
            no = c.options("/v1/completions", headers={"Origin": "https://evil.example", **pre})
            assert "access-control-allow-origin" not in no.headers
        # Plain HTTP to an HTTPS server gets no answer.
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https", "http") + "/health", timeout=5)
        assert "ready in" in srv.output() and "https://127.0.0.1" in srv.output()
        # start-up's objects left out of the GC's full collections (cli/serve.py)
        assert re.search(r"startup: [1-9][0-9]* objects frozen", srv.output()), srv.output()
    finally:
        assert srv.stop() == 0, srv.output()
