"""``python -m megacp.serve`` as a subprocess on a tiny random Llama with a character tokenizer:
the official ``openai`` client and raw httpx requests, 16 concurrent streaming clients at CP 1 and
CP 2 (torchrun, gloo) against offline ``LLM.generate`` (greedy), multi-turn prefix reuse against
transformers on the joined history, logprobs against ``LLM.generate``'s, OpenAI-style errors, a disconnect freeing its slot, SIGTERM
draining, the serving bench against a server. Two servers in all (module-scoped); on CPU their
running batch decodes with the CUDA graphs' static step, run eagerly. Beside them, one process
drives a :class:`~megacp.generate.worker.Worker` directly: requests joining and leaving the static and
the eager batch, and an engine stepped by hand admitting a burst of newcomers, against
``LLM.generate``."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.hf_models import hf_greedy, make_hf_model, save_char_tokenizer
from tests.helpers.paths import ROOT
from tests.helpers.serving import drive as _drive
from tests.helpers.serving import logprobs_close
from tests.helpers.serving import prompts as _prompts
from tests.helpers.timeouts import HANG_GUARD_S

NEW = 6
KEY = "sk-test"
BUDGET = 16
"""The servers' ``--max-num-batched-tokens``: prompts arriving while others decode are chunked."""
CHAT = [{"role": "user", "content": "hello there"}]
TOP = 3
"""Top log-probabilities asked per token."""


def _burst(llm, prompts: list[list[int]], ref: list[list[int]]) -> dict[str, object]:
    """An :class:`~megacp.serve.engine.Engine` stepped by hand: ``prompts[0]`` decodes, then
    ``prompts[1:5]`` wait at once with a budget of ``prompts[1:4]``'s tokens. Returns the prefill
    steps and chunks after each of the first two steps, the requests still prefilling after the
    burst's step, and whether every request got its ``ref`` tokens."""
    from megacp import SamplingParams
    from megacp.generate.worker import Worker
    from megacp.serve.engine import Engine, Request

    loop = asyncio.new_event_loop()
    worker = Worker(llm.generator, 5, 64, vocab=llm.model_config.vocab_size, static=True, capture=False)
    engine = Engine(worker, None, max_queue=8, max_batched_tokens=sum(len(p) for p in prompts[1:4]))
    reqs = [Request(p, SamplingParams(max_tokens=NEW, ignore_eos=True), loop=loop) for p in prompts[:5]]
    counts = []
    for arriving in (reqs[:1], reqs[1:]):
        engine.waiting.extend(arriving)
        engine.step()
        counts.append((engine.metrics["prefill_steps"], engine.metrics["prefill_chunks"]))
    prefilling = engine.status()["prefilling"]
    for _ in range(4 * NEW):
        if all(r.done for r in reqs):
            break
        engine.step()
    loop.close()
    return dict(counts=counts, prefilling=prefilling, exact=[r.tokens for r in reqs] == ref[:5])


def _offline(rank: int, n: int, path: str, prompts: list[list[int]]
             ) -> tuple[list[list[int]], dict[str, bool], dict[str, list[dict[int, float]]], dict[str, object]]:
    """``LLM.generate``'s greedy tokens of ``prompts``, whether a changing batch of requests of
    mixed sampling settings gets each one's offline tokens and logprobs from the static and eager
    batches, the greedy log-probabilities (``TOP``) of ``prompts[0]`` and of ``CHAT``, and
    :func:`_burst`'s outcome."""
    from megacp import LLM, SamplingParams
    from megacp.generate.worker import Worker

    llm = LLM(path, dtype="float32")
    ref = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    asked = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=TOP)
    logprobs = {"completion": llm.generate(prompts[0], asked)[0].logprobs, "chat": llm.chat(CHAT, asked)[0].logprobs}
    kinds = [dict(), dict(temperature=0.8, top_k=20), dict(repetition_penalty=1.3), dict(top_p=0.9, presence_penalty=0.5)]
    few = prompts[:10]
    params = [SamplingParams(max_tokens=2 + i % 5, seed=i, ignore_eos=True, logprobs=(None, 2, 0)[i % 3], **kinds[i % 4])
              for i in range(len(few))]
    outs = llm.generate(few, params)
    batches = {}
    for mode in ("static", "eager"):
        got, got_logprobs = _drive(Worker(llm.generator, 4, 64, vocab=llm.model_config.vocab_size,
                                          static=mode == "static", capture=False), few, params)
        batches[mode] = got == [o.token_ids for o in outs] and logprobs_close(got_logprobs, [o.logprobs for o in outs],
                                                                               1e-5)
    return ref, batches, logprobs, _burst(llm, prompts, ref)


def _start(cmd: list[str], port: int) -> subprocess.Popen:
    return subprocess.Popen(cmd + ["--port", str(port), "--dtype", "float32"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def _wait(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not come up")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("serve")
    hf = make_hf_model("llama3", d)
    save_char_tokenizer(d)
    ports = free_port(), free_port()
    one = _start([sys.executable, "-m", "megacp.serve", "--model", str(d), "--api-key", KEY,
                  "--served-model-name", "tiny", "--max-num-seqs", "16", "--max-model-len", "256",
                  "--max-num-batched-tokens", str(BUDGET)], ports[0])
    two = _start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                  str(free_port()), "-m", "megacp.serve", "--model", str(d), "--served-model-name", "tiny",
                  "--max-model-len", "256", "--max-num-batched-tokens", str(BUDGET)], ports[1])
    prompts = _prompts()
    ref, batches, logprobs, burst = run_distributed(_offline, 1, str(d), prompts)[0]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for proc, url in zip((one, two), urls):
            _wait(proc, url)
        yield dict(urls=urls, procs=(one, two), prompts=prompts, ref=ref, hf=hf, dir=str(d), batches=batches,
                   logprobs=logprobs, burst=burst)
    finally:
        for proc in (one, two):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], headers: dict) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True}
    tokens: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    return tokens


def test_the_eager_flag_and_its_vllm_alias() -> None:
    from megacp.serve.cli import parse_args

    assert not parse_args([]).no_cuda_graphs
    assert parse_args(["--no-cuda-graphs"]).no_cuda_graphs and parse_args(["--enforce-eager"]).no_cuda_graphs


def test_a_busy_port_is_one_line_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """The HTTP rank binds its port first: a taken one ends in one line and exit 2 within a second
    (the model would take seconds to load); --version answers."""
    import socket
    import time

    from megacp.serve.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert main(["--port", str(port)]) == 2
        assert time.monotonic() - start < 1.0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"megacp.serve: --host 127.0.0.1 --port {port}: cannot listen"), lines
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("megacp ")


def test_common_prefix_equals_a_token_by_token_count() -> None:
    import random

    from megacp.generate.engine import common_prefix

    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == want


def test_a_changing_batch_decodes_as_offline_generate(servers) -> None:
    """Requests joining and leaving the static batch (rows moved, padded sizes, mixed sampler
    features, some asking for logprobs) and the eager batch get the tokens and logprobs
    ``LLM.generate`` gives each."""
    assert servers["batches"] == {"static": True, "eager": True}


def test_a_burst_of_newcomers_is_prefilled_in_one_step(servers) -> None:
    """Three requests arriving together while one decodes are prefilled in one step (one forward)
    as their prompts fit the step's token budget; a fourth that does not fit waits for the next
    step; all five get ``LLM.generate``'s tokens."""
    burst = servers["burst"]
    assert burst["counts"] == [(1, 1), (2, 4)] and burst["prefilling"] == 1 and burst["exact"]


@pytest.mark.parametrize("cp", [1, 2])
def test_concurrent_streams_equal_offline_generate(servers, cp: int) -> None:
    url = servers["urls"][cp - 1]
    headers = {"Authorization": f"Bearer {KEY}"} if cp == 1 else {}

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_stream(client, url, p, headers) for p in servers["prompts"]))

    assert asyncio.run(main()) == servers["ref"]


def test_openai_client_completions_chat_and_streaming(servers) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=servers["urls"][0] + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    p, ref = servers["prompts"][0], servers["ref"][0]
    out = client.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == NEW
    assert out.model_extra is not None and out.choices[0].model_extra["token_ids"] == ref
    msgs = CHAT
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
    pieces = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=NEW, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == chat.choices[0].message.content
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(servers["dir"])
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert chat.choices[0].model_extra["token_ids"] == hf_greedy(servers["hf"], [list(ids)], NEW)[0]
    assert chat.usage.prompt_tokens == len(ids)


def test_logprobs_equal_offline_generate_in_openai_shapes(servers) -> None:
    """Greedy logprobs through the official client (a completion at CP 1, streamed at CP 2; a chat,
    plain and streamed) equal ``LLM.generate``'s within 1e-5, the chosen token being the most
    likely one; values out of range get OpenAI's 400."""
    from openai import BadRequestError, OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(servers["dir"])
    one, two = (OpenAI(base_url=u + "/v1", api_key=KEY) for u in servers["urls"])
    kw: dict = dict(model="tiny", max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
    want, ids = servers["logprobs"], servers["ref"][0]

    def close(got: dict[str, float], ref: dict[int, float]) -> bool:
        return got.keys() == {tok.decode([t]) for t in ref} and all(abs(got[tok.decode([t])] - v) <= 1e-5
                                                                    for t, v in ref.items())

    plain = one.completions.create(prompt=servers["prompts"][0], logprobs=TOP, **kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in two.completions.create(prompt=servers["prompts"][0], logprobs=TOP,
                                                                    stream=True, **kw)]
    streamed = {k: sum((getattr(c, k) for c in chunks if c is not None), []) for k in
                ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for lp in (plain.model_dump(), streamed):
        assert lp["tokens"] == [tok.decode([t]) for t in ids] and len(want["completion"]) == NEW
        assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i]) for i in range(NEW)]
        for t, value, top, ref in zip(ids, lp["token_logprobs"], lp["top_logprobs"], want["completion"]):
            assert close(top, ref) and abs(value - ref[t]) <= 1e-5 and value == max(top.values())
    chat = one.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=TOP, **kw).choices[0]
    pieces = [c.choices[0].logprobs for c in two.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=TOP,
                                                                         stream=True, **kw)]
    streamed_chat = [e for c in pieces if c is not None for e in c.content or []]
    assert chat.logprobs is not None and len(chat.logprobs.content or []) == NEW == len(streamed_chat)
    for content in (chat.logprobs.content or [], streamed_chat):
        for e, t, ref in zip(content, chat.model_extra["token_ids"], want["chat"]):
            assert e.token == tok.decode([t]) and e.bytes == list(e.token.encode()) and abs(e.logprob - ref[t]) <= 1e-5
            best = sorted(ref.items(), key=lambda x: -x[1])[:TOP]
            assert [x.token for x in e.top_logprobs] == [tok.decode([i]) for i, _ in best]
            assert all(abs(x.logprob - v) <= 1e-5 for x, (_, v) in zip(e.top_logprobs, best))
            assert e.top_logprobs[0].logprob == e.logprob
    bad = [(one.completions.create, dict(prompt=[5, 6], logprobs=21), "logprobs"),
           (one.chat.completions.create, dict(messages=CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
           (one.chat.completions.create, dict(messages=CHAT, top_logprobs=2), "top_logprobs")]
    for call, args, param in bad:
        with pytest.raises(BadRequestError) as err:
            call(model="tiny", max_tokens=2, **args)
        body = err.value.response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["param"] == param
        assert body["type"] == "invalid_request_error" and param in body["message"]


def test_multi_turn_reuses_the_cached_prefix(servers) -> None:
    url, headers = servers["urls"][0], {"Authorization": f"Bearer {KEY}"}
    history = servers["prompts"][1][:30] + [5, 6, 7, 8, 9] * 4
    previous = 0
    for turn in range(3):
        body = {"model": "tiny", "prompt": history, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30).json()
        got = r["choices"][0]["token_ids"]
        assert got == hf_greedy(servers["hf"], [history], NEW)[0]
        if turn:  # everything but the new turn came from the cache (the last reply token was fed one step late)
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == previous
        previous = len(history) + NEW
        history = history + got + [10 + turn, 11, 12]


def test_a_long_prompt_beside_decoding_streams_is_chunked(servers) -> None:
    """A 150-token prompt arriving while a stream decodes is prefilled in chunks of at most
    ``BUDGET`` tokens between the stream's decode steps; both get transformers' greedy tokens."""
    url, headers = servers["urls"][0], {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(url + "/metrics", headers=headers).json()
    stream_prompt, long_prompt = servers["prompts"][2], (servers["prompts"][3] * 40)[:150]
    body = {"model": "tiny", "prompt": stream_prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}
    streamed: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:  # the stream decodes before the long prompt arrives
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["token_ids"]
                break
        out = httpx.post(url + "/v1/completions", headers=headers, timeout=60, json={
            "model": "tiny", "prompt": long_prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}).json()
        for line in lines:
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["token_ids"]
    m = httpx.get(url + "/metrics", headers=headers).json()
    assert out["choices"][0]["token_ids"] == hf_greedy(servers["hf"], [long_prompt], NEW)[0]
    assert streamed == hf_greedy(servers["hf"], [stream_prompt], 120)[0]
    assert m["chunked_requests"] > before["chunked_requests"]
    assert m["prefill_chunks"] - before["prefill_chunks"] >= 150 // BUDGET
    assert 0 < m["max_prefill_beside_decode"] <= BUDGET
    steps = m["step_ms"]  # the engine's host time per step, decode-only and with prompt chunks
    assert steps["decode"]["steps"] >= 100 and steps["prefill"]["steps"] >= 150 // BUDGET
    assert all(0 < s["p50"] <= s["p99"] <= s["max"] for s in steps.values())


def test_bad_requests_get_openai_errors_and_the_server_goes_on(servers) -> None:
    url, headers = servers["urls"][0], {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    cases = [
        (dict(ok, model="gpt-9"), {}, 404, "model"),
        (dict(ok, max_tokens=-3), {}, 400, "max_tokens"),
        (dict(ok, prompt=[7] * 300), {}, 400, "prompt"),
        (dict(ok, n=2), {}, 400, "n"),
        (dict(ok, tools=[]), {}, 400, "tools"),
        (ok, {"Authorization": "Bearer nope"}, 401, None),
    ]
    for body, extra, status, param in cases:
        r = httpx.post(url + "/v1/completions", json=body, headers={**headers, **extra}, timeout=10)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=headers, timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", json=ok, headers=headers, timeout=10).json()["usage"]["completion_tokens"] >= 1


def test_oversized_bodies_loose_types_and_the_docs_are_refused(servers) -> None:
    """A body over --max-request-bytes (32 MiB) is refused with 413 in OpenAI's shape, by its declared
    length and while it streams, and /health answers meanwhile within a second; "5" and "yes" are no
    integer and no boolean; with an API key the docs and the schema are not served."""

    url, headers = servers["urls"][0], {"Authorization": f"Bearer {KEY}"}
    big = b'{"model": "tiny", "prompt": "' + b"a" * (50 << 20) + b'"}'
    r = httpx.post(url + "/v1/completions", content=big, headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():  # no Content-Length: refused once 32 MiB have come
        for _ in range(50):
            yield b"a" * (1 << 20)
    seen: list[float] = []
    slow = threading.Thread(target=lambda: seen.append(httpx.post(url + "/v1/completions", content=chunks(),
                                                                  headers=headers, timeout=60).status_code))
    slow.start()
    start = time.monotonic()
    assert httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
    assert time.monotonic() - start < 1.0
    slow.join()
    assert seen == [413]
    ok = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    for field, value in (("max_tokens", "5"), ("stream", "yes"), ("temperature", "0.5")):
        r = httpx.post(url + "/v1/completions", json=dict(ok, **{field: value}), headers=headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(url + path, timeout=10).status_code == 404
    # requests without a seed draw afresh (OpenAI's and vLLM's behaviour); seeded ones repeat
    sample = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    draws = [httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30).json()["choices"][0]["token_ids"]
             for body in (sample, sample, dict(sample, seed=9), dict(sample, seed=9))]
    assert draws[0] != draws[1] and draws[2] == draws[3]


def _rss_kib(pid: int) -> int:
    """The resident memory of process ``pid`` (KiB, from ``/proc``)."""
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0])


def test_a_text_longer_than_the_context_is_refused_before_it_is_tokenised(servers) -> None:
    """30 MiB of text (under the 32 MiB body limit; the character tokenizer would make 31M tokens of
    it) against the 256-token context: a completion and a chat are refused with 400
    context_length_exceeded naming the text's characters, before tokenising; the server holds no
    more than 256 MiB more afterwards, and goes on."""
    url, headers = servers["urls"][0], {"Authorization": f"Bearer {KEY}"}
    pid = servers["procs"][0].pid
    before = _rss_kib(pid)
    text = "a" * (30 << 20)
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": text}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]})):
        r = httpx.post(url + path, json=body, headers=headers, timeout=HANG_GUARD_S)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and f"of {30 << 20} characters is at least" in err["message"]
    assert _rss_kib(pid) - before < 256 << 10
    ok = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=ok, headers=headers,
                      timeout=HANG_GUARD_S).json()["usage"]["completion_tokens"] >= 1


def test_errors_name_no_source_paths_or_peer_addresses() -> None:
    from megacp.serve.engine import public_error

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:41235\nmore detail")
    assert public_error(gloo) == "RuntimeError: Connection closed by peer a peer"
    assert public_error(ValueError("plain")) == "ValueError: plain"


def test_the_serving_bench_runs_against_a_server(servers, tmp_path) -> None:
    """``scripts/bench/serve.py`` (its ``--url`` mode, small phases) measures both phases; the chat
    turns after the first come from the cache."""
    from scripts.bench.serve import main

    out = tmp_path / "serve.json"
    argv = ["--url", servers["urls"][0], "--served-model", "tiny", "--api-key", KEY, "--vocab", "256", "--tiny",
            "--history", "64", "--turns", "2", "--clients", "3", "--prompt-len", "8", "--max-tokens", "4",
            "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["streams"]["concurrent"]["tokens"] == 12 and res["streams"]["throughput_ratio"] > 0
    turns = res["chat"]["turns"]
    assert turns[0]["cold_cached_tokens"] == 0 and turns[1]["cached_tokens"] == turns[0]["prompt_tokens"] + 4


def test_a_disconnect_frees_the_slot_and_sigterm_drains(servers) -> None:
    url, headers = servers["urls"][0], {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                break
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        m = httpx.get(url + "/metrics", headers=headers).json()
        if m["running"] == 0:
            break
        time.sleep(0.05)
    assert m["running"] == 0 and m["generated_tokens"] < 1000
    before = m["generated_tokens"]  # a non-streaming request whose client leaves stops too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", headers=headers, timeout=0.05, json=dict(body, stream=False, max_tokens=240))
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        m = httpx.get(url + "/metrics", headers=headers).json()
        if m["running"] == 0:
            break
        time.sleep(0.05)
    assert m["running"] == 0 and m["generated_tokens"] - before < 240, m
    done: dict = {}

    def long() -> None:
        done.update(httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                               json=dict(body, stream=False, max_tokens=120)).json())

    t = threading.Thread(target=long)
    t.start()
    while httpx.get(url + "/metrics", headers=headers).json()["running"] == 0:
        time.sleep(0.02)
    proc = servers["procs"][0]
    proc.send_signal(signal.SIGTERM)
    t.join(HANG_GUARD_S)
    assert proc.wait(HANG_GUARD_S) == 0
    assert "nanobind" not in (proc.stdout.read() if proc.stdout else "")  # no finalization noise at exit
    assert done["usage"]["completion_tokens"] == 120 and done["choices"][0]["finish_reason"] == "length"


def test_a_frozen_rank_ends_the_cp2_server(servers, tmp_path) -> None:
    """CP 2 under torchrun with ``runtime.timeout_minutes`` 0.2 (12 s): rank 1 frozen (SIGSTOP), a
    request's step waits for it until the collective times out; the request gets an error, /health
    answers 503 with the reason, and the server exits non-zero, within the timeout + 30 s."""
    import os

    import psutil

    config = tmp_path / "cp2.json"
    config.write_text(json.dumps({"context_parallel": {"size": 2}, "runtime": {"timeout_minutes": 0.2}}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), "-m", "megacp.serve", "--model", servers["dir"], "--served-model-name",
                             "tiny", "--max-model-len", "256", "--deepspeed_config", str(config), "--port", str(port),
                             "--dtype", "float32"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(proc, url)
        ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "megacp.serve" in " ".join(p.cmdline())}
        ranks[1].send_signal(signal.SIGSTOP)
        start = time.monotonic()
        body = {"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 4}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        health = None
        while proc.poll() is None and time.monotonic() - start < 12 + 30:
            try:
                health = httpx.get(url + "/health", timeout=2)
            except httpx.HTTPError:
                pass
            if health is not None and health.status_code == 503:
                break
            time.sleep(0.2)
        assert health is not None and health.status_code == 503 and "error" in health.json(), health
        ranks[0].wait(12 + 30 - (time.monotonic() - start))  # the serving rank has exited
        ranks[1].send_signal(signal.SIGCONT)  # so that torchrun's SIGTERM reaches the frozen one
        assert proc.wait(30) != 0
        out = proc.stdout.read() if proc.stdout else ""
        assert "megacp.serve: the engine stopped:" in out and "exitcode  : 3" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
