"""Word problems with a calculator: the `rechner` tool evaluates 'Zahl Operator Zahl', and verify gives
reward 1.0 when the last number of the model's final message equals the row's expected_answer."""

import operator
import re

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([+*-])\s*(-?\d+)\s*$")


class RechnerResourcesServerConfig(BaseResourcesServerConfig):
    pass


class RechnerRequest(BaseModel):
    ausdruck: str


class RechnerVerifyRequest(BaseVerifyRequest):
    expected_answer: int


class RechnerResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: RechnerResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/rechner")(self.rechner)
        return app

    async def rechner(self, body: RechnerRequest) -> PlainTextResponse:
        match = EXPRESSION.match(body.ausdruck)
        if not match:
            return PlainTextResponse(f"Fehler: kein Ausdruck der Form 'Zahl Operator Zahl': {body.ausdruck!r}")
        left, symbol, right = match.groups()
        return PlainTextResponse(str(OPERATORS[symbol](int(left), int(right))))

    async def verify(self, body: RechnerVerifyRequest) -> BaseVerifyResponse:
        final = ""
        for item in body.response.output:
            if item.type == "message" and item.role == "assistant":
                final = "".join(part.text for part in item.content if part.type == "output_text")
            elif item.type == "function_call":
                final = ""
        numbers = re.findall(r"-?\d+", final)
        reward = float(bool(numbers) and int(numbers[-1]) == body.expected_answer)
        return BaseVerifyResponse(**body.model_dump(), reward=reward)


if __name__ == "__main__":
    RechnerResourcesServer.run_webserver()
