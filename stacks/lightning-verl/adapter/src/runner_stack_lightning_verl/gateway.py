"""The agl-server process: Agent Lightning 1.0.2's gateway + in-memory store (its `create_app` with its own
Hydra `server` config) under uvicorn on a listening socket it inherits.

    python -m runner_stack_lightning_verl.gateway --fd N --key K --model M --temperature T

Differences from the `agl-server` console script (which is `create_app(config)` + `uvicorn.run(host, port)`):
- the socket is bound by the parent on 127.0.0.1 and passed in (the script's default host is 0.0.0.0);
- the gateway's ProxyRouter is subclassed so that each rollout's upstream is the registered model endpoint
  under the rollout's `/episodes/<episode id>/v1` prefix. Stock 1.0.2 pins a rollout to one registered
  endpoint by hash and sends nothing upstream that names the rollout (only the JSON body and a
  content-type header), so the policy server could not attribute the call. The episode id is the
  rollout's `metadata.episode_id`, set by the adapter when it enqueues the rollout.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from runner_kit.policy import episode_base_url
from runner_kit.processes import freeze_heap

from .verl_launch import hydra_string


def episode_router_class():
    """agentlightning's ProxyRouter with a per-rollout upstream: `<registered root>/episodes/<id>/v1`."""
    from agentlightning.schemas import Model
    from agentlightning.server.proxy import ProxyRouter
    from agentlightning.server.store import _rollouts

    class EpisodeProxyRouter(ProxyRouter):
        def select_server(self, model: str, rollout_id: str) -> Model:
            server = super().select_server(model, rollout_id)
            rollout = _rollouts.get(rollout_id)
            extra = (rollout.metadata.model_extra or {}) if rollout is not None else {}
            episode = extra.get("episode_id")
            if not episode:  # a rollout the adapter did not enqueue: the policy server refuses it (HTTP 400)
                return server
            return server.model_copy(update={"endpoint": episode_base_url(server.endpoint, str(episode))})

    return EpisodeProxyRouter


def build_app(*, key: str, model: str, temperature: float):
    """agl-server's FastAPI app from its packaged Hydra config `server.yaml`, with our overrides."""
    import agentlightning.server.app as app_module
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="agentlightning.config", version_base=None):
        config = compose(config_name="server", overrides=[
            "host=127.0.0.1", f"key={key}", f"default_proxy.model_name={hydra_string(model)}",
            f"default_proxy.train.temperature={temperature}", f"default_proxy.val.temperature={temperature}",
            "default_proxy.include_log_probs=true",
        ])
    app_module.ProxyRouter = episode_router_class()  # create_app's lifespan builds the router by this name
    return app_module.create_app(config)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="an inherited socket bound to 127.0.0.1")
    parser.add_argument("--key", required=True, help="the store and gateway API key (bearer)")
    parser.add_argument("--model", required=True, help="the model name the gateway forwards to")
    parser.add_argument("--temperature", type=float, required=True, help="sampling temperature it forwards")
    args = parser.parse_args(argv)
    # agentlightning logs through structlog's default (stdout, debug level: a line per proxied call).
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    sock = socket.socket(fileno=args.fd)
    host = sock.getsockname()[0]
    if host != "127.0.0.1":
        raise SystemExit(f"refusing to serve on {host}: the socket must be bound to 127.0.0.1")
    app = build_app(key=args.key, model=args.model, temperature=args.temperature)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=120)
    freeze_heap()
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
