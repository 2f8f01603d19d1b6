"""The engine: requests, the step loop, the model runner, outputs and step events."""
