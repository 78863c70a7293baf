"""shop-total: what a basket costs, computed with the shop's price tool and stated as 'Total: <n>'."""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from qualification.tasks import Score, TaskItem, ToolParam, ToolSpec, Transcript

GOODS = ["notebook", "pencil", "apple", "ticket", "candle", "stamp", "battery", "mug"]
NAMES = ["Mia", "Noah", "Lena", "Omar", "Ines", "Theo"]
TOTAL = re.compile(r"^Total:\s*(-?\d+)\s*$")


def _total_line(text: str) -> int | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    match = TOTAL.match(lines[-1]) if lines else None
    return int(match.group(1)) if match else None


def _heldout(good: str, price: int, quantity: int) -> bool:
    # A fixed partition of the item space: held-out items never occur in train, whatever the seeds.
    return hashlib.sha256(f"{good}/{price}/{quantity}".encode()).digest()[0] % 5 == 0


class ShopTotal:
    name = "shop-total"
    scorer_version = 1
    synthetic = True
    frozen_splits = {"train": (64, 1), "heldout": (48, 2)}
    system_prompt = "Use the price tool. Answer with 'Total: <number>'."
    tools = (ToolSpec(name="price_total", description="The price of a basket: unit price times quantity.",
                      params=(ToolParam("unit_price", "integer", "Price of one item in coins."),
                              ToolParam("quantity", "integer", "How many items."))),)

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        rng = random.Random(f"{self.name}/{split}/{seed}")
        items: list[TaskItem] = []
        seen: set[tuple[str, int, int]] = set()
        while len(items) < n:
            good, price, quantity = rng.choice(GOODS), rng.randint(2, 19), rng.randint(2, 12)
            if (good, price, quantity) in seen or _heldout(good, price, quantity) != (split == "heldout"):
                continue
            seen.add((good, price, quantity))
            question = f"A {good} costs {price} coins. {rng.choice(NAMES)} buys {quantity}. How much is that?"
            items.append(TaskItem(family=self.name, split=split, task_id=f"{self.name}/{split}/{seed}/{len(items)}",
                                  question=question,
                                  reference={"unit_price": price, "quantity": quantity, "total": price * quantity}))
        return items

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        return {}

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        if name != "price_total":
            return f"error: unknown tool {name!r}"
        try:
            return str(int(arguments["unit_price"]) * int(arguments["quantity"]))
        except (KeyError, TypeError, ValueError):
            return "error: price_total needs integer unit_price and quantity"

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        total = _total_line(transcript.final_text)
        expected = item.reference["total"]
        results = [call.result for call in transcript.tool_calls if call.name == "price_total"]
        correct = total == expected
        grounded = correct and str(expected) in results  # the total must come from the tool
        components = {"tool_called": float(bool(results)), "well_formed": float(total is not None),
                      "correct": float(correct), "grounded": float(grounded)}
        return Score(reward=float(grounded), success=grounded, components=components,
                     outcome="success" if grounded else "failure")

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        ref = item.reference
        arguments = {"unit_price": ref["unit_price"], "quantity": ref["quantity"]}
        return [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "price_total", "arguments": arguments}}]},
            {"role": "tool", "name": "price_total", "content": str(ref["total"])},
            {"role": "assistant", "content": f"Total: {ref['total']}"},
        ]

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        ref = item.reference
        call = {"tool_call": {"name": "price_total",
                              "arguments": {"unit_price": ref["unit_price"], "quantity": ref["quantity"]}}}
        wrong = {"tool_call": {"name": "price_total",
                               "arguments": {"unit_price": ref["unit_price"], "quantity": ref["quantity"] + 1}}}
        return [
            {"case": "correct", "expected_success": True, "turns": [call, {"text": f"Total: {ref['total']}"}]},
            {"case": "wrong-total", "expected_success": False, "turns": [call, {"text": f"Total: {ref['total'] + 1}"}]},
            {"case": "no-tool", "expected_success": False, "turns": [{"text": f"Total: {ref['total']}"}]},
            {"case": "wrong-quantity", "expected_success": False,
             "turns": [wrong, {"text": f"Total: {ref['unit_price'] * (ref['quantity'] + 1)}"}]},
            {"case": "malformed-call", "expected_success": False,
             "turns": [{"raw_tool_call": '{"name": "price_total", "arguments": {"unit_price": '}]},
            {"case": "no-total-line", "expected_success": False, "turns": [call, {"text": f"It is {ref['total']}."}]},
        ]
