"""Per-sample attribution of Inspect's model calls, without touching the team's task: an Inspect hook adds
the header X-Episode-ID = <checkpoint label>/<the hook's sample id> to every call a sample makes (Inspect's
own requests name no sample). Inspect records each call's config, headers included, in the sample's events
in its log, so the id ties each call the policy server answered to the sample Inspect scored."""

from __future__ import annotations

from inspect_ai.hooks import BeforeModelGenerate, Hooks, hooks

LABEL = "policy"  # the checkpoint being evaluated (base | trained), set by the harness job

EPISODE_HEADER = "X-Episode-ID"


@hooks(name="runner_episode_header", description="names each model call's sample for runner's policy server")
class EpisodeHeader(Hooks):
    async def on_before_model_generate(self, data: BeforeModelGenerate) -> None:
        data.config.extra_headers = {**(data.config.extra_headers or {}), EPISODE_HEADER: f"{LABEL}/{data.sample_id}"}
