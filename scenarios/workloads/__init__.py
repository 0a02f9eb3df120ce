"""Built-in workloads: a byte-level GPT on the Python standard library, and a tiny MLP for tests."""
