"""`//tools:serve` as a user runs it: the default bundled model, free ports, one ready line,
an OpenAI client answered, and Ctrl-C stopping every component."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.servers import MODEL
from tools.launch import start


def test_serve_answers_an_openai_client_and_stops_on_ctrl_c(tmp_path):
    # The default model (`smollm2`) comes from the conversion cache; seed it with the folder
    # Bazel already converted, so the test does not convert again.
    (tmp_path / "smollm2-135m-instruct").symlink_to(Path(MODEL).resolve())
    os.environ["TANDEM_CACHE_DIR"] = str(tmp_path)
    proc, m = start(["tools.serve", "--port", "0", "--kv-cache-gb", "0.1"],
                    r"tandem ready: (http://\S+)", timeout=300)  # fmt: skip
    url = m.group(1)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        models = client.models.list()
        model = models.data[0].id
        messages = [{"role": "user", "content": "Name a colour."}]
        first = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        again = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        assert first.choices[0].message.content
        assert first.choices[0].message.content == again.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.HTTPError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the router still answers after Ctrl-C")


def test_serve_fails_fast_with_a_message_for_a_bad_model(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tools.serve", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "is not a Hugging Face folder" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "serve: --port 70000 is not a port number"),
        (["--aggregated", "--prefill", "vllm"], "serve: --aggregated starts no prefill: drop it,"),
        (["--aggregated", "--num-prefill", "2"], "serve: --aggregated starts no prefill: drop it,"),
    ],
)
def test_serve_refuses_flags_that_cannot_work_before_starting_anything(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "tools.serve", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and done.stderr.startswith(message), done.stderr
