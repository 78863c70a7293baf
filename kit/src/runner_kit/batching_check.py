"""Batch invariance, checked on a checkpoint: concurrent two-turn calc-tool episodes through the policy server
over real HTTP (their clients in a process of their own, as an environment's are), sampled one call at a
time and then batched; prints one JSON line with both runs' calls compared bit for bit, their wall time
and the sampler's evidence.

    python -m runner_kit.batching_check POLICY_DIR [--attention sdpa] [--episodes 48] [--fallbacks] [--padded]
    python -m runner_kit.batching_check --sampling

--fallbacks multiplies every linear one row at a time in batched steps and gives every row an attention call
of its own: the fallbacks for a weight shape whose batched matmul, or an SDPA whose batch, rounds otherwise on
this machine (the suite checks that they are exact too). --padded adds a third run, batched without batch
invariance (PaddedSampler): the baseline `make bench` prices exactness against. --sampling compares the batched
sampler with torch.multinomial called one row at a time (the sampler before batching) on random logits, greedy,
top-k and top-p rows mixed, and prints how many rows drew another token or logprob (and what a nan logit raises).

The suite (tests/test_policy_batching.py) and `make bench` (bench/bench_policy_server.py) run it in the trl
environment."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from unittest import mock

from qualification.tasks import get_family
from runner_contracts import SamplingSpec
from runner_kit.policy import openai_tools

from . import policy_server
from .batching import BatchingSampler
from .policy_server import PolicyServer

SAMPLING = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=40, seed=7)


def post(url: str, body: dict, episode: str) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                     "X-Episode-ID": episode})
    return json.loads(urllib.request.urlopen(request, timeout=600).read())


def episode(tokenizer, base_url: str, i: int) -> None:
    """A calc-tool train item in two turns: the question, then the conversation with the tool's result (or a
    nudge, when no tool was called). Two episodes ask each question, as a group's samples do (the second may
    start from the first one's prefill). Every third episode greedy, the others hot with top-k or top-p;
    every fourth episode's second turn token-in/token-out."""
    family = get_family("calc-tool")
    question = i // 2
    item = family.generate("train", question + 1, 0)[question]
    tools = openai_tools(family)
    params = [{"temperature": 0.0}, {"temperature": 1.3, "top_k": 20}, {"temperature": 0.9, "top_p": 0.8}][i % 3]
    messages = [{"role": "system", "content": family.system_prompt}, {"role": "user", "content": item.question}]
    reply = post(base_url + "/chat/completions", {"messages": messages, "tools": tools, **params},
                 f"e{i}")["choices"][0]["message"]
    messages.append({"role": "assistant", "content": reply.get("content") or "", **(
        {"tool_calls": reply["tool_calls"]} if reply.get("tool_calls") else {})})
    messages.append({"role": "tool", "content": str(item.reference["answer"])} if reply.get("tool_calls")
                    else {"role": "user", "content": "Nutze den Rechner."})
    if i % 4 == 3:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)
        post(base_url.removesuffix("/v1") + "/inference/v1/generate",
             {"token_ids": list(ids), "sampling_params": {"max_tokens": 24, **params}}, f"e{i}")
    else:
        post(base_url + "/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 24, **params},
             f"e{i}")


def drive(base_url: str, tokenizer_dir: str, episodes: int) -> None:
    """The episodes' clients, each on its own thread (run in a process of their own, as an environment's are)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    threads = [threading.Thread(target=episode, args=(tokenizer, base_url, i)) for i in range(episodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def watch_idle_mode(sampler, model) -> dict[str, int]:
    """Counts, each time the last call in flight returns, whether the model is in training mode (as a trainer
    waiting for its episodes leaves it) or still in the sampler's eval mode: a trainer whose episodes have all
    ended must find the model as it left it (TRL's GRPOTrainer takes its evaluation path otherwise). The
    batcher's thread pauses 50 ms after a step that ended its last calls, as a loaded machine may deschedule
    it there, so that a caller woken before the batcher leaves its inference mode would see it."""
    seen = {"train": 0, "eval": 0}
    lock, in_flight, sample, step = threading.Lock(), [0], sampler.sample, sampler._step

    def paused_step(active, cache):
        cache = step(active, cache)
        if not active:
            time.sleep(0.05)
        return cache

    def watched(*args, **kwargs):
        with lock:
            in_flight[0] += 1
        try:
            return sample(*args, **kwargs)
        finally:
            with lock:  # no call starts while the mode is read
                in_flight[0] -= 1
                if in_flight[0] == 0:
                    seen["train" if model.training else "eval"] += 1

    sampler.sample, sampler._step = watched, paused_step
    return seen


def run(model, tokenizer, policy_dir: str, episodes: int, max_rows: int, folder: str) -> tuple[dict, dict, float]:
    """(calls by id, the sampler's evidence with the model's mode whenever it went idle, wall seconds) of
    `episodes` concurrent episodes, the model in training mode as a trainer leaves it."""
    calls_path = Path(folder) / f"calls-{max_rows}.jsonl"
    model.train()
    server = PolicyServer(model, tokenizer, sampling=SAMPLING, calls_path=calls_path, revision="r",
                          max_rows=max_rows).start()
    idle_mode = watch_idle_mode(server.sampler, model)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "runner_kit.batching_check", policy_dir, "--drive", server.base_url,
                    "--episodes", str(episodes)], check=True)
    seconds = time.monotonic() - started
    server.close()
    calls = [json.loads(line) for line in calls_path.read_text().splitlines()]
    return {c["call_id"]: c for c in calls}, {**server.sampler.evidence(), "idle_mode": idle_mode}, seconds


class PaddedSampler(BatchingSampler):
    """Continuous batching without batch invariance, the baseline `make bench` measures exactness against: a
    decode step multiplies all its rows in one gemm per linear and attends them in one SDPA call per layer with
    each row's left padding masked, as vLLM and TRL's generate batch. A call's tokens then depend on what shares
    its steps (the gemm's and the kernel's rounding), which is why the policy server never samples this way."""

    max_logit_difference = float("nan")  # batched against alone, on the start-up check's calls

    def _compare_batched_with_alone(self) -> str:
        with self._inference():
            compared, refused = self.check_logits()
        self.max_logit_difference = max((float((b - a).abs().max()) for b, a in compared), default=float("nan"))
        return refused

    def evidence(self) -> dict:
        found = super().evidence()
        if self.mode == "batched":
            found.update(mode="batched, not batch-invariant (padded)", attention="one masked call per layer",
                         attention_calls=found["decode_steps"], mean_rows_per_attention_call=found["mean_rows"])
        return {**found, "max_logit_difference": self.max_logit_difference}

    def _decode(self, calls, tokens, cache):
        import torch

        device = self.model.device
        keys = cache.layers[0].keys.shape[2] + 1  # the padded cache's width once this step's keys are in
        lengths = torch.tensor([[call.length + 1] for call in calls], device=device)
        mask = (torch.arange(keys, device=device) >= keys - lengths).long()  # a row's own keys end the cache
        output, cache = self._forward(torch.tensor([[token] for token in tokens], device=device), cache,
                                      position_ids=torch.tensor([[call.length] for call in calls], device=device),
                                      attention_mask=mask)
        for call in calls:
            call.length += 1
        return output, cache


def compare_sampling(steps: int = 40) -> dict:
    """The batched sampler against torch.multinomial one row at a time, as the sampler drew before it batched
    (processed_logprobs, then torch.multinomial of their exp with the call's generator), on random logits for
    two vocabulary sizes: {"rows": compared, "differing": rows whose token or logprob differ, "nan_logit": the
    error a nan logit raises}.

    The reference is the sampler's old per-row code (_multinomial_one_row_at_a_time), kept as what batching must
    reproduce."""
    import torch

    from .batching import SAMPLING_CHECK_ROWS, sample, sampling_check_calls, sampling_differences

    compared = differing = 0
    for vocab, steps_here in ((642, steps), (151_936, 4)):
        rows, differ = sampling_differences(vocab, steps_here, _multinomial_one_row_at_a_time())
        compared, differing = compared + rows, differing + differ
    logits = torch.zeros(len(SAMPLING_CHECK_ROWS), 642)
    logits[1, 5] = float("nan")  # a sampled row's logit: nothing can be drawn from that row
    try:
        sample(sampling_check_calls(), logits)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return {"rows": compared, "differing": differing, "nan_logit": refused}


def _multinomial_one_row_at_a_time():
    """The sampler's per-row draw before it batched, one seeded generator per SAMPLING_CHECK_ROWS row, as a
    reference for sampling_differences."""
    import torch

    from .batching import SAMPLING_CHECK_ROWS, processed_logprobs

    generators = [torch.Generator().manual_seed(row) for row in range(len(SAMPLING_CHECK_ROWS))]

    def draw(row: int, logits) -> tuple[int, float]:
        temperature, top_p, top_k, greedy = SAMPLING_CHECK_ROWS[row]
        if greedy:
            scores = torch.log_softmax(logits[0], dim=-1)
            token = int(torch.argmax(scores))
        else:
            scores = processed_logprobs(logits[0], temperature, top_p, top_k)
            token = int(torch.multinomial(scores.exp(), 1, generator=generators[row]))
        return token, min(0.0, float(scores[token]))

    return draw


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy_dir", nargs="?")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--drive", metavar="BASE_URL", help="only run the episodes' clients against this server")
    parser.add_argument("--fallbacks", action="store_true",
                        help="batched steps multiply every linear and attend every row one row at a time")
    parser.add_argument("--padded", action="store_true",
                        help="also sample batched without batch invariance (PaddedSampler), to price exactness")
    parser.add_argument("--sampling", action="store_true", help="only compare sampling with torch.multinomial")
    args = parser.parse_args()
    if args.sampling:
        return print(json.dumps(compare_sampling()))
    if not args.policy_dir:
        parser.error("POLICY_DIR is needed unless --sampling")
    if args.drive:
        return drive(args.drive, args.policy_dir, args.episodes)
    if args.fallbacks:
        from . import batching

        batching._bmm_equals_rows = lambda module, counts, generator: False
        batching._attention_batch_invariance = lambda model: "forced by --fallbacks"
    import torch

    tokenizer = AutoTokenizer.from_pretrained(args.policy_dir)
    model = AutoModelForCausalLM.from_pretrained(args.policy_dir, attn_implementation=args.attention)
    threads_before = torch.get_num_threads()  # the trainer's count, which the sampler must leave as it was
    with tempfile.TemporaryDirectory() as folder:
        alone, alone_evidence, alone_s = run(model, tokenizer, args.policy_dir, args.episodes, 1, folder)
        batched, batched_evidence, batched_s = run(model, tokenizer, args.policy_dir, args.episodes, 64, folder)
        if args.padded:
            (Path(folder) / "padded").mkdir()
            with mock.patch.object(policy_server, "BatchingSampler", PaddedSampler):
                padded, padded_evidence, padded_s = run(model, tokenizer, args.policy_dir, args.episodes, 64,
                                                        str(Path(folder) / "padded"))
    keys = ("prompt_ids", "completion_ids", "logprobs", "finish_reason")

    def differing(calls: dict, fields: tuple[str, ...] = keys) -> list[str]:
        return sorted(k for k in alone if k in calls and any(alone[k][f] != calls[k][f] for f in fields))

    print(json.dumps({
        "calls": len(alone), "same_calls": sorted(alone) == sorted(batched),
        "differing": differing(batched),
        "tokens": sum(len(c["completion_ids"]) for c in alone.values()),
        "caller_threads": {"before": threads_before, "after": torch.get_num_threads()},
        "alone": {**alone_evidence, "seconds": round(alone_s, 3)},
        "batched": {**batched_evidence, "seconds": round(batched_s, 3)},
        **({"padded": {**padded_evidence, "seconds": round(padded_s, 3), "same_calls": sorted(alone) == sorted(padded),
                       "differing": len(differing(padded)),
                       "ids_differing": len(differing(padded, ("completion_ids",)))}} if args.padded else {}),
    }))


if __name__ == "__main__":
    main()
