"""The policy server's continuous batching is batch-invariant: many concurrent episodes sampled batched get
the token ids and logprobs (bit for bit) that one-at-a-time sampling gives them, whatever shares their
decode steps and when they start from another call's prefill of the same prompt; a model the server
cannot batch exactly is sampled one call at a time, and says why.

Runs the trl stack's PolicyServer on the cached tiny calc policy in the trl environment (real HTTP on
127.0.0.1, real concurrent clients). Slow: needs the trl environment and the tiny policy (built once,
cached under RUNNER_CACHE_DIR)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from runner.api import LocalEngine, build_tiny, get_stack, load_plan

pytestmark = pytest.mark.slow

PLAN = Path(__file__).resolve().parents[1] / "qualification" / "plans" / "calc-tool-cpu.yaml"

@pytest.fixture(scope="module")
def trl_and_policy():
    engine = LocalEngine()
    plan = load_plan(PLAN)
    return engine.prepare(get_stack("trl")), build_tiny(engine, dict(plan.policy.tiny or {}), plan)


def sample_both_ways(trl_and_policy, attention: str, episodes: int, *options: str) -> dict:
    trl, policy_dir = trl_and_policy
    run = subprocess.run([str(trl.python), "-m", "runner_kit.batching_check", str(policy_dir), "--attention",
                          attention, "--episodes", str(episodes), *options],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_concurrent_episodes_sampled_batched_equal_one_at_a_time_bit_for_bit(trl_and_policy):
    found = sample_both_ways(trl_and_policy, "sdpa", 48)
    assert found["calls"] == 96 and found["same_calls"], found
    assert found["differing"] == [], found["differing"]
    assert found["tokens"] > 96 * 3  # the calls decoded more than a token or two each
    assert found["alone"]["mode"] == "one at a time" and found["alone"]["decode_steps"] == 0
    # On CPU both ways compute with one intra-op thread, and the caller (the trainer) keeps its own count.
    assert found["alone"]["intra_op_threads"] == found["batched"]["intra_op_threads"] == 1, found
    assert found["caller_threads"]["after"] == found["caller_threads"]["before"], found["caller_threads"]
    # When the last call in flight returned, the model was in the training mode the trainer left it in, even
    # with the batcher's thread paused after its last step: a skyrl-gym train stage once lost a batch's
    # evidence to a caller that woke while the batcher still held the model in eval mode.
    for way in ("alone", "batched"):
        assert found[way]["idle_mode"]["eval"] == 0 and found[way]["idle_mode"]["train"] > 0, found[way]
        # the sampler thread's own CPU: never more than the seconds it was measured over
        assert 0 < found[way]["model_cpu_s"] <= found[way]["model_s"] + 0.002, found[way]
    batched = found["batched"]
    assert batched["mode"] == "batched" and "reason" not in batched, batched
    # Calls really shared decode steps: greedy, top-k and top-p calls side by side in one forward pass.
    assert batched["max_rows"] >= 8 and batched["mean_rows"] > 2, batched
    # Episodes asking the same question started from one prefill of it, and sampled what they sample alone.
    assert batched["prefills_shared"] > 0 and found["alone"]["prefills_shared"] == 0, batched
    assert batched["rows_decoded"] + batched["calls"] >= found["tokens"]
    # Two episodes ask each question: their rows have one length and share an attention call where this
    # machine's SDPA computes a row in a batch as alone (the server's start-up check); else each row has its own.
    if batched["attention"] == "rows of one length together":
        assert batched["mean_rows_per_attention_call"] > 1.2, batched
    else:
        assert batched["attention"].startswith("one row at a time: SDPA over"), batched
        assert batched["mean_rows_per_attention_call"] == 1.0, batched
        print(f"this machine's SDPA refused grouped attention: {batched['attention']}")


@pytest.fixture(scope="module")
def fallbacks_and_padded(trl_and_policy):
    """Eight episodes alone, batched with the fallbacks forced, and batched without batch invariance."""
    return sample_both_ways(trl_and_policy, "sdpa", 8, "--fallbacks", "--padded")


def test_the_row_by_row_fallbacks_in_batched_steps_are_exact_too(fallbacks_and_padded):
    """The fallbacks for a weight shape whose batched matmul rounds otherwise on this machine's BLAS (MKL's
    batched kernel on AVX-512 did at two intra-op threads, for the tiny policy's 642 x 128 lm_head) and for an
    SDPA that computes a row otherwise in a batch: forced, every linear multiplied and every row attended one row
    at a time."""
    found = fallbacks_and_padded
    assert found["same_calls"] and found["differing"] == [], found["differing"]
    batched = found["batched"]
    assert batched["mode"] == "batched" and batched["max_rows"] >= 4, batched
    assert "lm_head" in batched["linears_row_by_row"] and len(batched["linears_row_by_row"]) == 2 * 7 + 1, batched
    assert batched["attention"] == "one row at a time: forced by --fallbacks", batched
    assert batched["mean_rows_per_attention_call"] == 1.0, batched


def test_the_baseline_the_bench_prices_exactness_against_is_a_correct_batched_decoding(fallbacks_and_padded):
    """`make bench` measures what exactness costs against continuous batching that is not batch-invariant
    (batching_check --padded: one gemm per linear over all rows, one masked attention call per layer). That
    baseline must decode the same calls correctly, or the price is wrong: its logits at the start-up check
    within float rounding of one-at-a-time ones (with every key attended, padding included, they differed by
    0.29), every call answered, rows sharing steps."""
    found = fallbacks_and_padded
    padded = found["padded"]
    assert padded["mode"] == "batched, not batch-invariant (padded)" and padded["same_calls"], padded
    assert padded["max_logit_difference"] < 1e-4, padded
    assert padded["max_rows"] >= 4 and padded["mean_rows_per_attention_call"] == padded["mean_rows"] > 1, padded
    assert 0 <= padded["ids_differing"] <= padded["differing"] <= found["calls"], padded
    print(f"not batch-invariant: {padded['differing']} of {found['calls']} calls differ from one-at-a-time "
          f"({padded['ids_differing']} in their sampled ids); max logit difference "
          f"{padded['max_logit_difference']:.2g}")


def test_batched_sampling_draws_what_torch_multinomial_drew_one_row_at_a_time(trl_and_policy):
    """The sampler before batching called torch.multinomial per row; batched, each row draws the same noise from
    its own generator and computes the rest over all rows: the same token and logprob for every row (greedy,
    temperature, top-k and top-p rows mixed, vocabularies of 642 and 151936); a nan logit is refused by name,
    as torch.multinomial refused it."""
    trl, _ = trl_and_policy
    run = subprocess.run([str(trl.python), "-m", "runner_kit.batching_check", "--sampling"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found == {"rows": 7 * 40 + 7 * 4, "differing": 0, "nan_logit": "the policy's logits are not finite "
                     "(inf or nan): nothing can be sampled from them"}


def test_a_model_the_server_cannot_batch_exactly_is_sampled_one_call_at_a_time_and_says_why(trl_and_policy):
    found = sample_both_ways(trl_and_policy, "eager", 6)
    assert found["differing"] == [] and found["same_calls"]
    assert found["batched"]["mode"] == "one at a time"
    assert found["batched"]["reason"] == "attention implementation 'eager' (batching needs 'sdpa')"
    assert found["batched"]["decode_steps"] == 0


ENCODE_BOTH_WAYS = """
import json, sys
from transformers import AutoTokenizer
from runner_kit.policy import encode_text
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
tools = [{"type": "function", "function": {"name": "rechner", "description": "rechnet",
          "parameters": {"type": "object", "properties": {"ausdruck": {"type": "string", "description": "x"}},
                         "required": ["ausdruck"]}}}]
texts = [tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
         for messages in ([{"role": "user", "content": "Was ist 17 * 23?"}],
                          [{"role": "user", "content": "2 + 2"}, {"role": "assistant", "content": "4 <|im_end|> x"}])]
texts.append("<tool_call>\\n{}</tool_call>" + tokenizer.eos_token + "\\n<|im_start|>user")
same = [encode_text(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False) for text in texts]
tokenizer.backend_tokenizer.enable_truncation(max_length=5)  # another user of the tokenizer left it truncating
while_truncating = encode_text(tokenizer, texts[0])  # before transformers' encode turns truncation off
print(json.dumps({"same": same, "length": len(while_truncating),
                  "same_while_truncating": while_truncating == tokenizer.encode(texts[0], add_special_tokens=False)}))
"""


def test_a_prompt_is_encoded_as_transformers_does(trl_and_policy):
    """The policy server and verifiers' renderer tokenize with the fast tokenizer's own encode (`encode_text`: it
    keeps the GIL; transformers' encode lets go of it and waits to get it back): the same ids as transformers'
    encode, chat templates, special tokens in the text and all, and transformers' own path while the backend is
    set to truncate or pad."""
    trl, policy_dir = trl_and_policy
    run = subprocess.run([str(trl.python), "-c", ENCODE_BOTH_WAYS, str(policy_dir)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["same"] == [True, True, True] and found["same_while_truncating"], found
    assert found["length"] > 5, found  # not cut to the backend's truncation


# A module that replaces a buffer in its forward pass (as a dynamic rotary embedding re-registers inv_freq) and a
# training pass that saves that buffer for backward: the final norm's output times a `scale` buffer.
BUFFER_REPLACED = """
import json, sys, threading, torch
from transformers import AutoModelForCausalLM
from runner_kit.batching import BatchingSampler
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model.train()
norm = model.model.norm
norm.register_buffer("scale", torch.ones(model.config.hidden_size), persistent=False)
forward = norm.forward
def scaled(hidden):
    if torch.is_inference_mode_enabled():
        norm.register_buffer("scale", torch.ones_like(norm.scale), persistent=False)
    return forward(hidden) * norm.scale
norm.forward = scaled
sampler = BatchingSampler(model, {0}, max_rows=8)
threads = [threading.Thread(target=sampler.sample, args=([5 + n, 6, 7],),
                            kwargs=dict(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=n, greedy=False))
           for n in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
sampler.close()
ids = torch.tensor([[1, 2, 3, 4]])
model(input_ids=ids, labels=ids).loss.backward()
print(json.dumps({"mode": sampler.mode, "decode_steps": sampler.stats["decode_steps"],
                  "inference_buffers": [name for name, b in model.named_buffers() if b.is_inference()],
                  "trained": model.lm_head.weight.grad is not None, "training": model.training}))
"""


def test_a_buffer_the_samplers_forward_replaced_does_not_reach_the_trainer_as_an_inference_tensor(trl_and_policy):
    """The sampler runs under torch.inference_mode; a buffer its forward pass replaced would be an inference
    tensor, which autograd cannot save for backward: the trainer's next backward pass would fail."""
    trl, policy_dir = trl_and_policy
    run = subprocess.run([str(trl.python), "-c", BUFFER_REPLACED, str(policy_dir)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["mode"] == "batched" and found["decode_steps"] > 0, found
    assert found == {**found, "inference_buffers": [], "trained": True, "training": True}
