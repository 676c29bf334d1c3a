"""Throughput: choose the batch size and the plan together, by samples per second within the
budget (`search.plan_throughput`), and draw it (`plot`)."""
