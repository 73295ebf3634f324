"""How the shipped demo weights were made (see training/README.md for the pipeline)."""
