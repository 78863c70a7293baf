"""The verifiers stack (verifiers==0.4.0) in its own environment: our task families as a vf.Taskset with a
shared MCP vf.Toolset, episodes run by verifiers' env server (null harness, subprocess runtime) against scripted
policies: the chat-completions path (EvalClient) and the token-in/token-out path (TrainClient with a local
tokenizer), the env server SIGKILLed mid-batch through the serve stage's fault injection, and its tool server
and the chat program's fork server SIGKILLed between batches.

Slow: the first run builds the environment (~1 min; cached under RUNNER_CACHE_DIR afterwards); an env server
takes a few seconds to start the first time (fork servers import verifiers, its MCP tool server and openai
once), an episode then costs a fraction of a second of CPU (the chat program is forked pre-imported, the tool
server is shared).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import CALC_PLAN, leftover_processes, wait_until
from qualification.tasks import get_family, sources
from runner_contracts import EpisodeSpec
from runner_kit.policy import openai_tools
from runner_kit.scripted_policy import ScriptedPolicyServer
from stack_checks import (
    SAMPLING,
    assert_crash_mid_batch_loses_nothing,
    assert_only_its_own_upstream,
    installed_packages,
    reference,
)

from runner.api import LocalEngine, get_stack, scrubbed_env

pytestmark = pytest.mark.slow
RUNNER = str(Path(sys.executable).parent / "runner")


@pytest.fixture(scope="module")
def env():
    return LocalEngine().prepare(get_stack("verifiers"))


def scripted_episodes(families=tuple(sources()), max_turns: int = 8, all_cases: bool = False):
    """Per family one train item's first known-good and first known-bad scripted case (or all cases)."""
    episodes, cases = [], {}
    for name in families:
        family = get_family(name)
        item = family.generate("train", 1, 1)[0]
        chosen = family.scripted_cases(item)
        if not all_cases:
            chosen = [next(c for c in chosen if c["expected_success"]),
                      next(c for c in chosen if not c["expected_success"])]
        for case in chosen:
            episode_id = f"{name}/{case['case']}"
            episodes.append(EpisodeSpec(episode_id=episode_id, task_id=item.task_id, family=name,
                                        item=item.to_json(), seed=0, max_turns=max_turns))
            cases[episode_id] = (family, item, case)
    return episodes, cases


def assert_scores_as_reference(results: list[dict], cases: dict) -> None:
    for result in results:
        family, item, case = cases[result["episode_id"]]
        score = reference(family, item, result)
        assert result["status"] == "completed", result
        assert result["reward"] == score.reward and result["reward_components"] == score.components, result
        assert result["success"] is score.success is case["expected_success"], result
        # Tool results are the family's own: replaying the calls on a fresh state gives the same strings.
        state = family.initial_state(item)
        assert [c["result"] for c in result["tool_calls"]] == [
            family.call_tool(item, state, c["name"], c["arguments"]) for c in result["tool_calls"]], result


def test_environment_has_verifiers_and_no_other_stack(env):
    assert_only_its_own_upstream(env)
    packages = installed_packages(env)
    # The null harness's chat program runs on this interpreter: its PEP 723 dependencies must be here.
    assert packages["mcp"] == "2.0.0" and {"openai", "httpx", "httpx2", "tenacity", "certifi"} <= set(packages)


# Runs in the stack environment: episodes through the backend (BatchRunner, as the serve stage runs them).
DRIVER = r"""
import json, sys
import msgspec
from runner_contracts import EpisodeSpec, RolloutRequest, SamplingSpec
from runner_kit.rollout import BatchRunner
from runner_stack_verifiers.backend import VerifiersBackend

args = json.loads(sys.stdin.read())
backend = VerifiersBackend(log_dir=args["log_dir"])
backend.start()
try:
    request = RolloutRequest(episodes=[msgspec.convert(e, EpisodeSpec) for e in args["episodes"]],
                             policy_base_url=args["base_url"], policy_model=args["model"],
                             tokenizer_dir=args.get("tokenizer_dir"),
                             sampling=msgspec.convert(args["sampling"], SamplingSpec), concurrency=4)
    response = BatchRunner(backend).run(request)
    for result in response.results:
        print(json.dumps(msgspec.to_builtins(result)), flush=True)
finally:
    backend.stop()
"""


def run_driver(env, tmp_path: Path, args: dict) -> list[dict]:
    home = tmp_path / "home"
    run = subprocess.run([str(env.python), "-c", DRIVER], input=json.dumps({**args, "log_dir": str(tmp_path)}),
                         capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env=scrubbed_env(env.path / "bin", home))
    log = tmp_path / "verifiers-envserver.log"
    assert run.returncode == 0, run.stderr[-3000:] + (log.read_text()[-3000:] if log.is_file() else "")
    # No uv, no script environment resolved from PyPI at run time.
    assert not (home / ".local").exists() and not (home / ".cache" / "uv").exists()
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_scripted_episodes_score_as_the_reference(env, tmp_path):
    episodes, cases = scripted_episodes()
    # And one episode cut off by its turn limit: business-comm's good script needs five turns, it gets three.
    family = get_family("business-comm")
    item = family.generate("train", 1, 1)[0]
    good = next(c for c in family.scripted_cases(item) if c["expected_success"])
    cut = EpisodeSpec(episode_id="business-comm/cut", task_id=item.task_id, family=family.name,
                      item=item.to_json(), seed=0, max_turns=3)
    scripts = {**{e: c[2]["turns"] for e, c in cases.items()}, cut.episode_id: good["turns"]}
    with ScriptedPolicyServer(scripts) as policy:
        results = run_driver(env, tmp_path, {"base_url": policy.base_url, "model": policy.model,
                                             "sampling": msgspec.to_builtins(SAMPLING),
                                             "episodes": [msgspec.to_builtins(e) for e in [*episodes, cut]]})
        calls = list(policy.calls)
    assert [r["episode_id"] for r in results] == [e.episode_id for e in [*episodes, cut]]
    *results, truncated = results
    # Every policy call names its episode in its body's metadata (the rollout's sampling config, one client for
    # all rollouts).
    assert {c["episode_id"] for c in calls} == set(scripts) and {c["channel"] for c in calls} == {"metadata"}
    assert_scores_as_reference(results, cases)
    # Only the family's own tools, with exactly the declared schemas, reach the policy.
    for call in calls:
        tools = sorted(call["body"].get("tools") or [], key=lambda tool: tool["function"]["name"])
        assert tools == openai_tools(get_family(call["episode_id"].split("/")[0]))
    # Truncated as the reference loop truncates: three model calls, the third turn's tool call ran and its
    # result (never sent back to the policy) is recorded.
    assert truncated["status"] == "completed" and truncated["outcome"] == "truncated", truncated
    assert truncated["finish_reason"] == "max_turns" and truncated["turns"] == 3
    assert len(truncated["tool_calls"]) == 3 and all(c["result"] for c in truncated["tool_calls"]), truncated
    assert_scores_as_reference([truncated], {cut.episode_id: (family, item, {"expected_success": False})})


# Runs in the stack environment: writes a small byte-level BPE tokenizer with the Qwen2.5 chat template the
# tiny policies use, and serves scripted turns token-in/token-out (as the policy server's /generate does).
TOKEN_POLICY = r"""
import json, sys, threading
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from runner_kit.http import JsonServer, Reply
from runner_kit.policy import GENERATE_PATH, MODELS_PATH, models_body, require_episode, token_logprobs

TEMPLATE = r'''{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- endif %}{%- for message in messages %}{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- elif message.role == "assistant" %}{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}{%- elif message.role == "tool" %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}'''


def write_tokenizer(directory: Path, corpus: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None}))
    (directory / "chat_template.jinja").write_text(TEMPLATE)


class TokenScriptedPolicy:
    model = "scripted-token-policy"

    def __init__(self, scripts, tokenizer_dir):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.scripts, self.calls, self.lock = scripts, [], threading.Lock()
        self.server = JsonServer([("GET", MODELS_PATH, self._models), ("POST", GENERATE_PATH, self._generate)])

    def _models(self, call):  # as the policy server's: no episode needed
        with self.lock:
            self.calls.append({"endpoint": "models", "path": call.path})
        return Reply(body=models_body(self.model))

    def _generate(self, call):
        episode, channel = require_episode(call)
        ids = call.body["token_ids"]
        index = self.tok.decode(ids).count("<|im_start|>assistant") - 1
        turns = self.scripts[episode]
        turn = turns[index] if index < len(turns) else {"text": ""}
        if "tool_call" in turn:
            text = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (
                turn["tool_call"]["name"], json.dumps(turn["tool_call"]["arguments"], ensure_ascii=False))
        elif "raw_tool_call" in turn:
            text = "<tool_call>\n" + turn["raw_tool_call"] + "\n</tool_call>"
        else:
            text = turn["text"]
        completion = self.tok.encode(text, add_special_tokens=False) + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        with self.lock:
            self.calls.append({"endpoint": "generate", "episode_id": episode, "channel": channel, "prompt_ids": ids,
                               "completion_ids": completion, "sampling_params": call.body.get("sampling_params")})
        return Reply(body={"choices": [{"index": 0, "token_ids": completion, "finish_reason": "stop",
                                        "logprobs": {"content": token_logprobs(completion, [-0.5] * len(completion))}}],
                           "prompt_token_ids": ids, "model": self.model})
"""

TOKEN_DRIVER = TOKEN_POLICY + r"""
import msgspec
from runner_contracts import EpisodeSpec, RolloutRequest, SamplingSpec
from runner_kit.policy import openai_tools
from runner_kit.rollout import BatchRunner
from qualification.tasks import TaskItem, families, get_family
from runner_stack_verifiers.backend import VerifiersBackend

args = json.loads(sys.stdin.read())
tokenizer_dir = Path(args["log_dir"]) / "tokenizer"
corpus = []
for family in families().values():
    for item in family.generate("train", 20, 1):
        corpus += [family.system_prompt, item.question, json.dumps(openai_tools(family), ensure_ascii=False)]
        corpus += [json.dumps(c["turns"], ensure_ascii=False) for c in family.scripted_cases(item)]
write_tokenizer(tokenizer_dir, corpus)
policy = TokenScriptedPolicy(args["scripts"], str(tokenizer_dir))
policy.server.start()
backend = VerifiersBackend(log_dir=args["log_dir"])
backend.start()
try:
    episodes = [msgspec.convert(e, EpisodeSpec) for e in args["episodes"]]
    request = RolloutRequest(episodes=episodes, policy_base_url=policy.server.url + "/v1", policy_model=policy.model,
                             tokenizer_dir=str(tokenizer_dir),
                             sampling=msgspec.convert(args["sampling"], SamplingSpec), concurrency=4)
    response = BatchRunner(backend).run(request)
finally:
    backend.stop()
    policy.server.stop()
# The first prompt of each episode, rendered independently as the trainer renders it (tools with a string
# `return`, sorted by name), must be what the policy received.
first = {}
for episode in episodes:
    item = TaskItem.from_json(episode.item)
    family = get_family(item.family)
    tools = [{"type": "function", "function": {**t["function"], "return": {"type": "string"}}}
             for t in openai_tools(family)]
    text = policy.tok.apply_chat_template([{"role": "system", "content": family.system_prompt},
                                           {"role": "user", "content": item.question}],
                                          tools=tools or None, tokenize=False, add_generation_prompt=True)
    first[episode.episode_id] = policy.tok.encode(text, add_special_tokens=False)
print(json.dumps({"results": [msgspec.to_builtins(r) for r in response.results], "calls": policy.calls,
                  "first_prompts": first}))
"""


def test_token_in_token_out_episodes(env, tmp_path):
    episodes, cases = scripted_episodes(families=("business-comm", "calc-tool"))
    home = tmp_path / "home"
    args = {"episodes": [msgspec.to_builtins(e) for e in episodes], "sampling": msgspec.to_builtins(SAMPLING),
            "scripts": {e: c[2]["turns"] for e, c in cases.items()}, "log_dir": str(tmp_path)}
    run = subprocess.run([str(env.python), "-c", TOKEN_DRIVER], input=json.dumps(args), capture_output=True,
                         text=True, timeout=240, cwd=tmp_path, env=scrubbed_env(env.path / "bin", home))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert_scores_as_reference(out["results"], cases)
    generate = [c for c in out["calls"] if c["endpoint"] == "generate"]
    # One client for every rollout: the models lookup happens once, at the shared base URL, and each call names
    # its episode in its sampling params' metadata.
    assert [c for c in out["calls"] if c["endpoint"] == "models"] == [{"endpoint": "models", "path": "/v1/models"}]
    assert {c["channel"] for c in generate} == {"metadata"} and {c["episode_id"] for c in generate} == set(cases)
    for episode_id in cases:
        mine = [c for c in generate if c["episode_id"] == episode_id]
        assert mine[0]["prompt_ids"] == out["first_prompts"][episode_id]
        # Each later prompt extends the previous prompt + the sampled ids: nothing sampled is re-tokenised.
        for before, after in zip(mine, mine[1:]):
            assert after["prompt_ids"][:len(before["prompt_ids"]) + len(before["completion_ids"])] == \
                before["prompt_ids"] + before["completion_ids"]
        assert mine[0]["sampling_params"]["max_tokens"] == SAMPLING.max_new_tokens


# Runs in the stack environment: what TrainClient's renderer pool imports when it first loads a tokenizer, after
# the env server imported its RENDERER_MODULES.
RENDERER_BUILD = TOKEN_POLICY + r"""
from runner_kit.prefork import warm_up
from runner_stack_verifiers.envserver import RENDERER_MODULES

tokenizer_dir = Path(sys.argv[1])
write_tokenizer(tokenizer_dir, ["Antwort: 42", "<tool_call>"])
warm_up(RENDERER_MODULES)  # as the env server's main does
before = set(sys.modules)
from renderers import create_renderer
from renderers.base import load_tokenizer
from renderers.configs import CustomRendererConfig
from runner_stack_verifiers.renderer import import_path

renderer = create_renderer(load_tokenizer(str(tokenizer_dir)), CustomRendererConfig(import_path=import_path("hermes")))
ids = renderer.render([{"role": "user", "content": "Antwort?"}], add_generation_prompt=True).token_ids
print(json.dumps({"ids": len(ids), "imported": sorted(set(sys.modules) - before)}))
"""


def test_the_env_server_imports_what_the_renderer_pool_loads_before_it_serves(env, tmp_path):
    """Verifiers' TrainClient loads the policy's tokenizer in the env server on the first model call of a run;
    its transformers import (~0.8 s of CPU, holding the GIL every rollout needs) happens at the env server's start
    instead, while the trainer starts: what is left to import then is the tokenizer's own model module."""
    run = subprocess.run([str(env.python), "-c", RENDERER_BUILD, str(tmp_path / "tokenizer")], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=scrubbed_env(env.path / "bin", tmp_path / "home"))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["ids"] > 0
    late = [name for name in out["imported"] if name.partition(".")[0] == "transformers"
            and not name.startswith("transformers.models.")]
    assert late == [], late
    # The env server itself has imported them once it serves: its address file is written after the warm-up,
    # and transformers' tokenizer classes load the tokenizers extension, which verifiers' own imports do not.
    ready, log = tmp_path / "envserver.address", tmp_path / "envserver.log"
    with log.open("wb") as stderr:  # a file, not a pipe nobody reads while the server starts
        server = subprocess.Popen([str(env.python), "-m", "runner_stack_verifiers.envserver", str(ready)],
                                  stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path,
                                  env=scrubbed_env(env.path / "bin", tmp_path / "home"))
    try:
        wait_until(lambda: ready.is_file() or server.poll() is not None, "the env server's address file", 120)
        assert ready.is_file(), f"the env server exited {server.returncode}: {log.read_text()[-3000:]}"
        maps = Path(f"/proc/{server.pid}/maps").read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "tokenizers.abi3" in maps, log.read_text()[-3000:]


def test_environment_killed_mid_batch_loses_no_episode(env, tmp_path):
    # The env server (and every rollout process under it) is SIGKILLed when the 6th episode starts.
    assert_crash_mid_batch_loses_nothing(env, tmp_path, ["business-comm", "calc-tool", "german-rag-cited"])


# Runs in the stack environment: a batch, then the shared tool server SIGKILLed, a batch, then the fork server
# SIGKILLed, a batch; each death is noticed, the env server replaced, and the affected episodes retried.
HELPERS_DRIVER = r"""
import json, os, signal, sys, time
import msgspec
from runner_contracts import EpisodeSpec, RolloutRequest, SamplingSpec
from runner_kit.rollout import BatchRunner
from runner_kit.processes import command_line, process_table, tree
from runner_stack_verifiers.backend import FORK_SERVER_MODULE, VerifiersBackend

def tool_servers():  # forks of the backend's fork server, as the env server is, but not the env server
    return [pid for pid, (parent, _) in process_table().items()
            if parent == backend._prefork.process.pid and pid != backend.environment_pids()[0]]

args = json.loads(sys.stdin.read())
backend = VerifiersBackend(log_dir=args["log_dir"])
backend.start()
out = []
try:
    for step, batch in enumerate(args["batches"]):
        killed = None
        if step == 1:
            killed = tool_servers()
        elif step == 2:  # [1:]: the env server is a fork of the backend's fork server, and has its cmdline
            below = tree(backend.environment_pids()[0])[1:]
            killed = [pid for pid, _ in below if FORK_SERVER_MODULE in command_line(pid)]
        if killed:
            os.kill(killed[0], signal.SIGKILL)
        request = RolloutRequest(episodes=[msgspec.convert(e, EpisodeSpec) for e in batch],
                                 policy_base_url=args["base_url"], policy_model=args["model"],
                                 sampling=msgspec.convert(args["sampling"], SamplingSpec), concurrency=2,
                                 max_attempts=3)
        response = BatchRunner(backend).run(request)
        parent = int(open(f"/proc/{backend.environment_pids()[0]}/stat").read().rsplit(")", 1)[1].split()[1])
        out.append({"killed": killed, "restarts": response.environment_restarts, "starts": backend.starts,
                    "forked": parent == backend._prefork.process.pid, "tool_servers": len(tool_servers()),
                    "results": [msgspec.to_builtins(r) for r in response.results]})
finally:
    backend.stop()
print(json.dumps(out))
"""


def test_tool_server_or_fork_server_killed_loses_no_episode(env, tmp_path):
    batches, cases = [], {}
    for tag in ("before", "tools-killed", "fork-killed"):
        episodes, batch_cases = scripted_episodes(families=("business-comm", "calc-tool"))
        renamed = [msgspec.structs.replace(e, episode_id=f"{e.episode_id}/{tag}") for e in episodes]
        batches.append(renamed)
        cases.update({f"{k}/{tag}": v for k, v in batch_cases.items()})
    with ScriptedPolicyServer({e: c[2]["turns"] for e, c in cases.items()}) as policy:
        home = tmp_path / "home"
        args = {"base_url": policy.base_url, "model": policy.model, "sampling": msgspec.to_builtins(SAMPLING),
                "batches": [[msgspec.to_builtins(e) for e in batch] for batch in batches], "log_dir": str(tmp_path)}
        run = subprocess.run([str(env.python), "-c", HELPERS_DRIVER], input=json.dumps(args), capture_output=True,
                             text=True, timeout=240, cwd=tmp_path, env=scrubbed_env(env.path / "bin", home))
    assert run.returncode == 0, run.stderr[-3000:]
    before, tools_killed, fork_killed = json.loads(run.stdout.splitlines()[-1])
    assert before["restarts"] == 0 and before["starts"] == 1
    # Each killed helper took the env server with it once: one restart, the episodes that hit it retried.
    assert tools_killed["killed"] and tools_killed["restarts"] == 1 and tools_killed["starts"] == 2
    assert fork_killed["killed"] and fork_killed["restarts"] == 1 and fork_killed["starts"] == 3
    # Every env server, the first and the restarted ones, was a fork of the backend's fork server (which imported
    # verifiers once), not a cold start, and so was each one's tool server.
    assert [batch["forked"] for batch in (before, tools_killed, fork_killed)] == [True, True, True]
    assert [batch["tool_servers"] for batch in (before, tools_killed, fork_killed)] == [1, 1, 1]
    for batch in (before, tools_killed, fork_killed):
        assert_scores_as_reference(batch["results"], cases)


def test_a_sigkilled_runner_leaves_no_verifiers_process(env, tmp_path):
    """`runner qualify` SIGKILLed while Verifiers' env server and its MCP tool server (started by verifiers
    in sessions of their own) serve the service stage: the job's supervisor ends all of them."""
    run_dir = tmp_path / "killed"
    runner = subprocess.Popen([RUNNER, "qualify", "--stack", "verifiers", "--plan", str(CALC_PLAN), "--stages",
                               "probe,service", "--run-dir", str(run_dir), "--json"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any("runner_stack_verifiers.toolset" in p for p in leftover_processes(run_dir)),
                   "the MCP tool server of the service stage", 300)
    finally:
        runner.kill()
        runner.wait()
    wait_until(lambda: not leftover_processes(run_dir), "every process of the killed run to end", 30)
