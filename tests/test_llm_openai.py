"""OpenAIGenerator against a small fake OpenAI-compatible server (FastAPI on a loopback port)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sleuth.errors import ConfigError, ServiceError
from sleuth.llm.base import SamplingParams
from sleuth.llm.openai_http import OpenAIGenerator, OpenAIOptions, parse_choice, parse_token_ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """Replies "reply to <prompt> </search> tail", cut at the first stop string like OpenAI servers do.

    vLLM-style extensions (stop_reason, include_stop_str_in_output, token ids) are honoured when asked.
    """

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.flaky_failures_left = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay = 0.0
        self._lock = threading.Lock()
        app = FastAPI()

        def reply(prompt_text: str, body: dict, chat: bool) -> dict:
            text = f"reply to {prompt_text} </search> tail"
            finish, stop_reason = "length", None
            for stop in body.get("stop") or []:
                at = text.find(stop)
                if at >= 0:
                    text = text[: at + len(stop)] if body.get("include_stop_str_in_output") else text[:at]
                    finish, stop_reason = "stop", stop
                    break
            choice: dict = {"index": 0, "finish_reason": finish}
            if body.get("return_tokens_as_token_ids"):
                choice["stop_reason"] = stop_reason
            tokens = [f"token_id:{ord(c)}" if body.get("return_tokens_as_token_ids") else c for c in text]
            logprobs = [-0.01 * (i + 1) for i in range(len(text))]
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                if body.get("logprobs"):
                    choice["logprobs"] = {
                        "content": [
                            {"token": t, "logprob": lp} for t, lp in zip(tokens, logprobs, strict=True)
                        ]
                    }
            else:
                choice["text"] = text
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"tokens": tokens, "token_logprobs": logprobs}
            return {"choices": [choice]}

        async def handle(request: Request, chat: bool, flaky: bool, text_only: bool = False):
            import asyncio

            body = await request.json()
            if text_only and not isinstance(body.get("prompt", ""), str):  # as `transformers serve` does
                return JSONResponse({"detail": "prompt must be a string."}, status_code=400)
            with self._lock:
                self.requests.append(body)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                fail = flaky and self.flaky_failures_left > 0
                if fail:
                    self.flaky_failures_left -= 1
            try:
                await asyncio.sleep(self.delay)
                if fail:
                    return JSONResponse({"error": "overloaded"}, status_code=503)
                if body.get("model") != "fake-model":
                    return JSONResponse({"error": f"unknown model {body.get('model')}"}, status_code=404)
                if chat:
                    prompt_text = body["messages"][-1]["content"]
                elif isinstance(body["prompt"], list):
                    prompt_text = "ids " + " ".join(map(str, body["prompt"]))
                else:
                    prompt_text = body["prompt"]
                return reply(prompt_text, body, chat)
            finally:
                with self._lock:
                    self.in_flight -= 1

        for prefix, flaky, text_only in (
            ("/v1", False, False),
            ("/flaky/v1", True, False),
            ("/textonly/v1", False, True),
        ):

            async def chat_route(request: Request, flaky: bool = flaky):
                return await handle(request, True, flaky)

            async def completion_route(request: Request, flaky: bool = flaky, text_only: bool = text_only):
                return await handle(request, False, flaky, text_only)

            app.post(f"{prefix}/chat/completions")(chat_route)
            app.post(f"{prefix}/completions")(completion_route)
        self.app = app

    def start(self) -> str:
        import uvicorn

        port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    url = fake.start()
    fake.url = url
    yield fake
    fake.stop()


@pytest.fixture(autouse=True)
def reset_server(server):
    server.requests.clear()
    server.flaky_failures_left = 0
    server.delay = 0.0
    server.max_in_flight = 0


P = SamplingParams(max_new_tokens=32, temperature=0.0, seed=5)


def test_chat_text_and_token_prompts_hit_the_right_endpoints(server):
    gen = OpenAIGenerator(f"{server.url}/v1", "fake-model", options=OpenAIOptions(chat=True))
    outs = gen.generate(["hello", [{"role": "user", "content": "hi there"}], [1, 2, 3]], params=P)
    assert [o.text for o in outs] == [
        "reply to hello </search> tail",
        "reply to hi there </search> tail",
        "reply to ids 1 2 3 </search> tail",
    ]
    assert all(o.finish_reason == "length" for o in outs)
    assert "messages" in server.requests[0] or "messages" in server.requests[1]
    token_request = next(r for r in server.requests if "prompt" in r)
    assert token_request["prompt"] == [1, 2, 3] and token_request["logprobs"] == 0
    # distinct seeds per item, so repeated prompts give distinct samples
    assert sorted(r["seed"] for r in server.requests) == [5, 6, 7]
    # plain-text servers return text tokens: log-probs yes, token ids no
    assert outs[0].token_ids == [] and outs[0].logprobs == pytest.approx(
        [-0.01 * (i + 1) for i in range(len(outs[0].text))]
    )


def test_completions_mode_for_text(server):
    gen = OpenAIGenerator(f"{server.url}/v1", "fake-model", options=OpenAIOptions(chat=False))
    (out,) = gen.generate(["plain"], params=P)
    assert "prompt" in server.requests[0] and out.text.startswith("reply to plain")


def test_stop_string_is_restored_in_text(server):
    gen = OpenAIGenerator(f"{server.url}/v1", "fake-model")
    outs = gen.generate(["a", "b"], stop=[["</search>"], ["nope"]], params=P)
    assert (
        outs[0].text == "reply to a </search>"
        and outs[0].finish_reason == "stop"
        and outs[0].stop == "</search>"
    )
    assert outs[1].finish_reason == "length" and outs[1].stop is None


def test_vllm_extensions_give_token_ids_and_stop_reason(server):
    gen = OpenAIGenerator(f"{server.url}/v1", "fake-model", options=OpenAIOptions(vllm_extensions=True))
    (out,) = gen.generate(["q"], stop=["</search>", "</answer>"], params=P)
    assert out.text == "reply to q </search>" and out.stop == "</search>" and out.finish_reason == "stop"
    assert out.token_ids == [ord(c) for c in out.text]
    assert len(out.logprobs) == len(out.token_ids)


def test_retries_a_failing_then_succeeding_endpoint(server):
    server.flaky_failures_left = 2
    gen = OpenAIGenerator(
        f"{server.url}/flaky/v1", "fake-model", options=OpenAIOptions(retries=3, backoff=0.01)
    )
    (out,) = gen.generate(["x"], params=P)
    assert out.text.startswith("reply to x") and len(server.requests) == 3


def test_gives_up_with_service_error(server):
    server.flaky_failures_left = 10
    gen = OpenAIGenerator(
        f"{server.url}/flaky/v1", "fake-model", options=OpenAIOptions(retries=2, backoff=0.01)
    )
    with pytest.raises(ServiceError, match="failed after 2 attempts.*503"):
        gen.generate(["x"], params=P)


def test_dead_server_raises_service_error():
    gen = OpenAIGenerator(
        f"http://127.0.0.1:{_free_port()}/v1",
        "fake-model",
        options=OpenAIOptions(retries=2, backoff=0.01, timeout=2),
    )
    with pytest.raises(
        ServiceError, match=r"POST http://127\.0\.0\.1:\d+/v1/chat/completions failed after 2"
    ):
        gen.generate(["x"], params=P)


def test_client_errors_are_not_retried(server):
    gen = OpenAIGenerator(f"{server.url}/v1", "other-model", options=OpenAIOptions(retries=4, backoff=0.01))
    with pytest.raises(ServiceError, match="HTTP 404.*unknown model other-model"):
        gen.generate(["x"], params=P)
    assert len(server.requests) == 1


def test_concurrency_is_bounded(server):
    server.delay = 0.1
    gen = OpenAIGenerator(f"{server.url}/v1", "fake-model", options=OpenAIOptions(max_concurrency=3))
    outs = gen.generate([f"p{i}" for i in range(9)], params=P)
    assert [o.text for o in outs] == [f"reply to p{i} </search> tail" for i in range(9)]
    assert 2 <= server.max_in_flight <= 3


def test_parsers_and_bad_config():
    assert parse_token_ids(["token_id:5", "token_id:17"]) == [5, 17]
    assert parse_token_ids(["token_id:5", "hello"]) == []
    eos = parse_choice({"finish_reason": "stop", "stop_reason": None, "text": "done"}, ["</a>"], chat=False)
    assert eos.finish_reason == "eos" and eos.text == "done"
    with pytest.raises(ConfigError, match="base_url"):
        OpenAIGenerator("localhost:8000", "m")


def test_an_unknown_openai_spec_option_is_named() -> None:
    from sleuth.llm.registry import load_generator

    with pytest.raises(ConfigError, match="unknown option.*bogus"):
        load_generator({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m", "bogus": 1})
    gen = load_generator(
        {"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m", "chat": False, "retries": 2}
    )
    assert isinstance(gen, OpenAIGenerator) and gen.chat is False and gen.retries == 2


def test_a_slow_answer_is_not_sent_again(server):
    """A request that times out waiting for its answer is still being computed: resending it would double the
    server's work, so it fails at once, saying how to wait longer."""
    server.delay = 1.0
    gen = OpenAIGenerator(
        f"{server.url}/v1", "fake-model", options=OpenAIOptions(retries=4, backoff=0.01, timeout=0.3)
    )
    with pytest.raises(
        ServiceError, match=r"no answer within 0.3 s; not sent again .* SLEUTH_OPENAI_TIMEOUT"
    ):
        gen.generate(["x"], params=P)
    time.sleep(1.2)  # let the server finish what it was computing
    assert len(server.requests) == 1


def test_the_timeout_is_an_option(server, monkeypatch, tmp_path):
    import json

    from typer.testing import CliRunner

    from sleuth.cli import app
    from sleuth.llm.registry import load_generator

    spec = f"openai:{server.url}/v1#fake-model"
    assert load_generator(spec).timeout == 60.0
    monkeypatch.setenv("SLEUTH_OPENAI_TIMEOUT", "123")
    gen = load_generator(spec)
    assert gen.timeout == 123.0 and gen._client.timeout.read == 123.0
    monkeypatch.setenv("SLEUTH_OPENAI_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="SLEUTH_OPENAI_TIMEOUT='soon'"):
        load_generator(spec)
    monkeypatch.delenv("SLEUTH_OPENAI_TIMEOUT")

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"id": "q0", "question": "Where?", "golden_answers": ["x"]}) + "\n")
    server.delay = 1.0
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "-m",
            "direct",
            "--data",
            str(data),
            "--model",
            spec,
            "--out",
            str(tmp_path / "out"),
            "--openai-timeout",
            "0.3",
        ],
        env={"COLUMNS": "300"},
    )
    assert result.exit_code == 2 and "no answer within 0.3 s" in result.output, result.output
    time.sleep(1.2)
    assert len(server.requests) == 1


def test_a_server_taking_text_only_gets_the_prompt_as_text(server):
    """`transformers serve` refuses token-id prompts: with the model's tokenizer the same prompt goes as the text
    the ids decode to (and stays text for later requests); without one, the error names what to pass."""
    from transformers import AutoTokenizer

    from sleuth.llm.registry import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    ids = tok.encode("hello there", add_special_tokens=False)
    bare = OpenAIGenerator(f"{server.url}/textonly/v1", "fake-model", options=OpenAIOptions(backoff=0.01))
    with pytest.raises(ServiceError, match=r"refused a prompt of token ids.*--tokenizer DIR"):
        bare.generate([ids], params=P)
    gen = OpenAIGenerator(
        f"{server.url}/textonly/v1", "fake-model", tokenizer=tok, options=OpenAIOptions(backoff=0.01)
    )
    (out,) = gen.generate([ids], params=P)
    assert out.text.startswith("reply to hello there") and gen.text_prompts
    server.requests.clear()
    gen.generate([ids], params=P)
    assert [r["prompt"] for r in server.requests] == ["hello there"]  # no second refusal


def test_a_stop_string_kept_in_the_text_ends_the_turn_there():
    # transformers serve keeps the stop string and may run past it within the token that completed it
    gen = parse_choice(
        {"finish_reason": "stop", "text": "a <search> q </search>\n\nmore"},
        ["</search>", "</answer>"],
        chat=False,
    )
    assert (gen.text, gen.stop, gen.finish_reason) == ("a <search> q </search>", "</search>", "stop")


def test_an_openai_model_named_by_a_local_directory_brings_its_tokenizer(tmp_path):
    from sleuth.llm.registry import load_generator, tiny_model_dir

    served = load_generator(f"openai:http://127.0.0.1:9/v1#{tiny_model_dir()}")
    assert served.tokenizer is not None and served.model == str(tiny_model_dir())
    assert load_generator("openai:http://127.0.0.1:9/v1#some-model").tokenizer is None
    with_tok = load_generator(
        {
            "backend": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "model": "m",
            "tokenizer": str(tiny_model_dir()),
        }
    )
    assert with_tok.tokenizer is not None
    with pytest.raises(ConfigError, match="tokenizer .*: not a directory holding tokenizer_config.json"):
        load_generator(
            {
                "backend": "openai",
                "base_url": "http://127.0.0.1:9/v1",
                "model": "m",
                "tokenizer": str(tmp_path),
            }
        )


def test_an_agent_through_a_served_model_without_tokenizer_is_refused_before_any_method(
    server, small_world, tmp_path
):
    from typer.testing import CliRunner

    from sleuth.cli import app

    result = CliRunner().invoke(
        app,
        [
            "eval",
            "-m",
            "naive-rag,search-r1",
            "--data",
            str(small_world / "test.jsonl"),
            "--retriever",
            str(small_world / "bm25"),
            "--model",
            f"openai:{server.url}/v1#fake-model",
            "--out",
            str(tmp_path / "out"),
            "--limit",
            "1",
        ],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 2 and "pass --tokenizer DIR" in result.output, result.output
    assert (
        not (tmp_path / "out" / "naive-rag").exists() and server.requests == []
    )  # refused before naive-rag ran
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "-m",
            "direct",
            "--data",
            str(small_world / "test.jsonl"),
            "--model",
            "tiny",
            "--tokenizer",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 2 and "only an openai: --model needs one" in result.output
