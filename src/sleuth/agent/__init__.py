"""Agent loops (Search-R1, s3, R-Search, staged reward, QAgent) and the shared rollout engine."""

from sleuth.agent.registry import get_loop, loop_names

__all__ = ["get_loop", "loop_names"]
