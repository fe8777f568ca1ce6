"""OpenAI-compatible servers (vLLM, SGLang, ...): the completions endpoint with our token-id prompt.

We send the prompt already rendered with the target's template (token ids), so a server's output
matches in-process generation. Several URLs serve data-parallel: requests are spread round-robin
and kept `concurrency` deep per server. Transient failures (connection errors, 429, 5xx) are retried
with exponential backoff; a request that still fails comes back as an error, never dropped.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from nestling.errors import NestlingError
from nestling.progress import log
from nestling.regenerate.engine import Completion, Request
from nestling.regenerate.settings import RegenerateSettings


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class OpenAIEngine:
    name = "openai"

    def __init__(self, s: RegenerateSettings):
        if not s.urls:
            raise NestlingError("engine 'openai' needs at least one server URL (--url http://HOST:PORT)")
        self.s = s
        self.urls = [_base(u) for u in s.urls]
        self.key = os.environ.get(s.api_key_env, "")
        models = self._get(self.urls[0] + "/v1/models")
        if not models.get("data"):
            raise NestlingError(f"server {self.urls[0]} lists no models at /v1/models")
        self.model = s.server_model or models["data"][0]["id"]
        served = {m["id"]: m for m in models["data"]}
        if self.model not in served:
            raise NestlingError(f"server {self.urls[0]} does not serve {self.model!r}; it serves {', '.join(served)}")
        self.max_model_len = served[self.model].get("max_model_len")
        self.pool = ThreadPoolExecutor(max_workers=max(1, s.concurrency) * len(self.urls))
        log(f"[regenerate] using {len(self.urls)} server(s), model {self.model!r}, max_model_len {self.max_model_len}")

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        return h

    def _get(self, url: str) -> dict:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=self._headers()), timeout=30) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise NestlingError(f"cannot reach the server at {url}: {e} (is it running? is --url right?)") from None

    def _post(self, url: str, body: dict) -> Completion:
        data = json.dumps(body).encode()
        delay, last = 1.0, ""
        for attempt in range(self.s.retries + 1):
            try:
                req = urllib.request.Request(url, data=data, headers=self._headers(), method="POST")
                with urllib.request.urlopen(req, timeout=self.s.timeout_s) as r:
                    out = json.loads(r.read())
                c = out["choices"][0]
                ids = c.get("token_ids")
                n = len(ids) if ids is not None else int(out.get("usage", {}).get("completion_tokens", 0))
                return Completion(
                    text=c.get("text", ""),
                    token_ids=list(ids) if ids is not None else None,
                    num_tokens=n,
                    finish_reason=c.get("finish_reason") or "",
                )
            except urllib.error.HTTPError as e:
                msg = e.read().decode(errors="replace")[:500]
                if e.code != 429 and e.code < 500:  # the request itself is wrong (e.g. too long): no retry
                    return Completion(error="server_rejected", detail=f"HTTP {e.code}: {msg}")
                last = f"HTTP {e.code}: {msg}"
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.s.retries:
                time.sleep(delay)
                delay = min(delay * 2, 60.0)
        return Completion(error="server_error", detail=f"after {self.s.retries} retries: {last}"[:500])

    def _one(self, i: int, r: Request) -> Completion:
        body = {
            "model": self.model,
            "prompt": r.prompt_ids,
            "max_tokens": r.max_tokens,
            "temperature": self.s.temperature,
            "top_p": self.s.top_p,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if self.s.top_k:
            body["top_k"] = self.s.top_k
        if self.s.temperature > 0:
            body["seed"] = r.seed
        return self._post(self.urls[i % len(self.urls)] + "/v1/completions", body)

    def generate(self, requests: list[Request]) -> list[Completion]:
        return list(self.pool.map(self._one, range(len(requests)), requests))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
