"""Rollouts: environments, tools, rollout trees, the async multi-turn collector, C3PO++."""
