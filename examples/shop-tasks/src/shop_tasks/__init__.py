"""Example task package for runner: one family, shop-total (docs/tasks.md)."""
