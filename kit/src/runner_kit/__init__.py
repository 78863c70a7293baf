"""runner-kit: the adapter kit, installed in every stack environment beside runner-contracts and the task
families (runner-qualification). A stack adapter uses its upstream, these modules, contracts and tasks,
nothing else of ours:

- runner_kit.rollout: the rollout-service scaffold (RolloutBackend; ServerBackend for one server process;
  BatchRunner, adapter_main), PolicyEndpoint
  (one policy call under the episode's id), environment_info and reachability for the probe;
- runner_kit.policy: the policy protocol (paths, episode header, attempt ids, tool rendering and parsing);
- runner_kit.continuity: training rows from captured calls by exact prefix continuity;
- runner_kit.http: a small JSON server and client on 127.0.0.1;
- runner_kit.scripted_policy: the scripted policy server the service stage runs episodes against;
- runner_kit.reference_backend: our own environment server, the model an adapter can be checked against;
- runner_kit.policy_server: the OpenAI-compatible policy server over a trainer's live Hugging Face model (every
  call logged with its exact ids and logprobs), which environment stacks call; runner_kit.batching: its
  batch-invariant continuous batching (needs torch and transformers: import it only where they are);
  runner_kit.batching_check: batched vs one-at-a-time sampling on a checkpoint, compared bit for bit;
- runner_kit.processes: servers on 127.0.0.1 (bind_loopback, free_port), children that die with the
  adapter from any thread (spawn), readiness waits, SIGKILL of a whole tree, ServerProcess.

How to write a stack with it: docs/adapters.md.
"""
