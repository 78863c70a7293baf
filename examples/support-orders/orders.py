"""The support-orders dataset's one tool, as a team would write it: an order's status by its number.

`runner tasks from-dataset` copies this file into the task package; every arm calls it as
order_status(state, order_id) (state: the episode's state, here {"row": ...}) and shows the policy
what it returns."""

import re

STATUSES = ("shipped", "delivered", "processing", "cancelled", "returned")


def order_status(state: dict, order_id: str) -> str:
    if not re.fullmatch(r"[A-Z]-\d{4}", order_id.strip()):
        raise ValueError(f"no order {order_id!r}; order numbers look like A-1234")
    return STATUSES[sum(int(digit) for digit in order_id if digit.isdigit()) % len(STATUSES)]
