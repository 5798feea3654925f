"""sleuth: train, evaluate and serve RL-trained LLM search agents for retrieval-augmented QA."""

__version__ = "0.1.0"
