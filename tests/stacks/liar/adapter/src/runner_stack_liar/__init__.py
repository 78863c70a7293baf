"""A stack that lies, to prove the host believes files, not adapters (a test stand-in, never a real stack).

- service stage: the first scripted episode its backend runs fails (wherever it runs: the rollout service or
  the stage's own process), and service.jsonl leaves it out;
- GET /environment names a decoy process it started (and pid 1) instead of its environment, which runs
  in this process and so never crashes;
- every episode's captured_calls (a gateway's token capture) has its first sampled id changed, so the
  trainer trains on ids the policy server never sampled.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
from runner_contracts import CapturedCall, EpisodeResult, EpisodeSpec, ServiceCase, read_jsonl, write_atomic
from runner_kit.http import post_json
from runner_kit.reference_backend import ReferenceBackend
from runner_kit.rollout import PolicyEndpoint, adapter_main


class _CapturingEndpoint(PolicyEndpoint):
    """Asks the policy server for its token ids and keeps them, as a gateway would."""

    def __init__(self, inner: PolicyEndpoint):
        super().__init__(base_url=inner.base_url, model=inner.model, sampling=inner.sampling,
                         tokenizer_dir=inner.tokenizer_dir)
        object.__setattr__(self, "captured", [])

    def chat(self, episode_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
             timeout_s: float = 300.0) -> tuple[dict[str, Any], str]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.sampling.temperature,
                                "top_p": self.sampling.top_p, "top_k": self.sampling.top_k,
                                "max_tokens": self.sampling.max_new_tokens, "logprobs": True,
                                "return_token_ids": True, **({"tools": tools} if tools else {})}
        reply = post_json(self.base_url.rstrip("/") + "/chat/completions", body, headers=self.headers(episode_id),
                          timeout=timeout_s)
        choice = reply["choices"][0]
        self.captured.append(CapturedCall(prompt_ids=reply["prompt_token_ids"], completion_ids=choice["token_ids"],
                                          logprobs=[t["logprob"] for t in choice["logprobs"]["content"]]))
        return choice["message"], choice.get("finish_reason") or ""


class LyingBackend(ReferenceBackend):
    stack = "liar"

    def __init__(self) -> None:
        super().__init__()
        self.decoy: subprocess.Popen | None = None
        self._failed_one = threading.Lock()  # taken by the one scripted episode that fails

    def environment_pids(self) -> list[int]:
        if self.decoy is None:
            self.decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        return [self.decoy.pid, 1]

    def run_episode(self, episode: EpisodeSpec, policy: PolicyEndpoint) -> EpisodeResult:
        if episode.episode_id.startswith("service/"):
            if self._failed_one.acquire(blocking=False):
                raise RuntimeError("the liar's environment failed this scripted episode")
            return super().run_episode(episode, policy)
        capturing = _CapturingEndpoint(policy)
        result = super().run_episode(episode, capturing)
        lied = [msgspec.structs.replace(call, completion_ids=[_other(call.completion_ids[0]), *call.completion_ids[1:]])
                if call.completion_ids else call for call in capturing.captured]
        return msgspec.structs.replace(result, captured_calls=lied)

    def stop(self) -> None:
        super().stop()
        if self.decoy is not None:
            self.decoy.kill()
            self.decoy.wait()


def _other(token: int) -> int:
    return token - 1 if token > 0 else token + 1


def run(request):
    backend = LyingBackend()
    if request.stage != "service":
        return adapter_main(backend, request)
    result = adapter_main(backend, request)
    path = Path(request.out_dir) / "service.jsonl"
    honest = read_jsonl(path, ServiceCase)
    write_atomic(path, b"".join(msgspec.json.encode(case) + b"\n" for case in honest if case.status == "completed"))
    return result
