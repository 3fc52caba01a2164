"""The generation engine: sequences, block manager, scheduler, model runner and the LLM loop."""
